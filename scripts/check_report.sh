#!/usr/bin/env bash
# defines: a check of a `moetrain report` page in a real headless browser: the page is loaded with chromium
# (Debian's chromium or chromium-headless-shell: apt-get install -y chromium-headless-shell), its DOM as the browser
# built it must hold every chart's <svg> with its lines, and a screenshot must not be blank (many non-white pixels,
# the charts' colours among them). Not part of CI (no browser there); run it by hand:
#   bash scripts/check_report.sh runs/tiny_moe/report.html [OUT_DIR]
# Writes OUT_DIR/report.png (default: beside the page) and exits non-zero with a message on any failure.
set -euo pipefail
page="${1:?usage: check_report.sh PAGE.html [OUT_DIR]}"
[[ -f "$page" ]] || { echo "check_report: no page at $page" >&2; exit 1; }
out="${2:-$(dirname "$page")}"
mkdir -p "$out"
browser=""
for b in chromium-headless-shell chromium chromium-browser google-chrome; do
  if command -v "$b" >/dev/null; then browser="$b"; break; fi
done
[[ -n "$browser" ]] || { echo "check_report: no headless browser (apt-get install -y chromium-headless-shell)" >&2; exit 1; }
url="file://$(cd "$(dirname "$page")" && pwd)/$(basename "$page")"
flags=(--headless --no-sandbox --disable-gpu --hide-scrollbars --no-first-run)
dom="$out/report.dom.html"
"$browser" "${flags[@]}" --dump-dom "$url" >"$dom" 2>"$out/browser.log"
shot="$out/report.png"
rm -f "$shot"
"$browser" "${flags[@]}" --window-size=1500,2600 --screenshot="$shot" "$url" >>"$out/browser.log" 2>&1
[[ -s "$shot" ]] || { echo "check_report: the browser wrote no screenshot (see $out/browser.log)" >&2; exit 1; }
python3 - "$dom" "$shot" <<'EOF'
import re, struct, sys, zlib

dom = open(sys.argv[1], encoding="utf-8").read()
problems = []
svgs = len(re.findall(r"<svg\b", dom))
charts = re.findall(r'<figure class="chart" id="chart-([a-z_]+)"', dom)
for needed in ["loss", "lr", "grad_norm", "tokens_per_s", "load_balance"]:
    if needed not in charts:
        problems.append(f"the DOM has no chart '{needed}'")
if svgs != len(charts):
    problems.append(f"{len(charts)} charts but {svgs} <svg> elements in the DOM")
lines = re.findall(r'<polyline[^>]*points="([^"]*)"', dom)
if len(lines) < 5 or any(len(p.split()) < 2 for p in lines):
    problems.append(f"expected a drawn line in every chart, found {len(lines)} polylines")
if "<table" not in dom or "Configuration" not in dom:
    problems.append("the DOM lacks the summary table or the configuration section")


def read_png(path):
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    width, height, depth, color, _, _, interlace = header
    assert depth == 8 and color in (2, 6) and interlace == 0, f"unsupported PNG {header}"
    bpp = 3 if color == 2 else 4
    raw, stride, rows, prev = zlib.decompress(idat), width * bpp, [], bytearray(width * bpp)
    for y in range(height):
        f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if f == 1: line[i] = (line[i] + a) & 255
            elif f == 2: line[i] = (line[i] + b) & 255
            elif f == 3: line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(line)
        prev = line
    return width, height, bpp, rows


w, h, bpp, rows = read_png(sys.argv[2])
non_white, colours = 0, set()
for line in rows[::2]:
    for x in range(0, w, 2):
        px = tuple(line[x * bpp:x * bpp + 3])
        if px != (255, 255, 255) and px != (250, 250, 250):
            non_white += 1
        colours.add(px)
share = non_white / ((h // 2) * (w // 2))
loss_blue = any(abs(r - 0x1f) < 24 and abs(g - 0x77) < 24 and abs(b - 0xb4) < 24 for r, g, b in colours)
if share < 0.02:
    problems.append(f"the screenshot is nearly blank ({100 * share:.2f}% non-white pixels)")
if not loss_blue:
    problems.append("the screenshot has no pixel of the loss line's colour")
print(f"check_report: DOM: {len(charts)} charts, {svgs} svg, {len(lines)} polylines; screenshot {w}x{h}, "
      f"{100 * share:.1f}% non-white, {len(colours)} colours")
if problems:
    print("check_report: FAILED:\n  " + "\n  ".join(problems), file=sys.stderr)
    sys.exit(1)
print("check_report: ok")
EOF
