// defines: the safe creation of outputs: a temporary file beside the destination, created with
// O_CREAT | O_EXCL | O_NOFOLLOW (so an existing name, a symlink planted there included, is never opened or
// truncated), written, synced and renamed over the destination. Every output the engine writes whole (safetensors,
// config.json, indexed datasets) goes through it, as checkpoint saves do.
#pragma once

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

namespace moetrain::io {

// Creates a new, empty file "<path>.tmp-<pid>-<n>" in the destination folder, taking the first n whose name does not
// exist; returns its descriptor (write-only, close-on-exec) and sets *tmp to its name. Errors name the path.
int create_temporary_beside(const std::string& path, std::string* tmp);

// Writes the chunks to a temporary file beside `path`, syncs it, renames it over `path` and syncs the folder. On any
// failure the temporary file is removed and `path` is untouched. `what` starts the error messages ("safetensors").
void write_file_atomically(const std::string& path, const std::vector<std::pair<const void*, size_t>>& chunks,
                           const std::string& what);

// Syncs the folder holding `path` (after a rename into it).
void fsync_folder_of(const std::string& path, const std::string& what);

}  // namespace moetrain::io
