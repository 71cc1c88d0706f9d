# defines: the library path moetrain runs with on the GPU machine, sourced by the GPU scripts (bench/run_bench.sh,
# bench/run_family_bench.sh, scripts/gpu_check.sh): PyTorch's cuDNN first when its environment has one. There the
# default path holds cuDNN 9.14, whose head-dim-256 attention backward is wrong (moetrain then runs it on its own
# kernels), and PyTorch's environment holds 9.19, which is right and fast (docs/gpu_notes.md). Set
# MOETRAIN_SYSTEM_CUDNN=1 to keep the default path.
if [[ "${MOETRAIN_SYSTEM_CUDNN:-0}" != 1 ]]; then
  moetrain_site=$(python3 -c 'import site; print(site.getsitepackages()[0])' 2>/dev/null || true)
  if [[ -n "$moetrain_site" && -d "$moetrain_site/nvidia/cudnn/lib" ]]; then
    export LD_LIBRARY_PATH="$moetrain_site/nvidia/cudnn/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  fi
  unset moetrain_site
fi
