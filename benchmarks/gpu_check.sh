#!/usr/bin/env bash
# GPU check for the engine (docs/benchmarks.md, "GPU"): on a CUDA machine, in under 8 minutes,
#   1. the lossless tests on cuda: every algorithm's greedy output against plain decoding through the
#      engine's loop (fp32 and bf16, up to ties) and sampling by chi-square (tests/engine/test_cuda.py);
#   2. the engine bench in bf16 against transformers generate in bf16, T=0 (12 prompts x 96 tokens).
# Usage: benchmarks/gpu_check.sh [OUT_DIR]      (default bench_out/gpu; writes tests.txt and bench/)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-bench_out/gpu}"
mkdir -p "$OUT"

python -c 'import ace_mw.engine' 2>/dev/null || python -m pip install -q --no-deps -e .
python - <<'PY' | tee "$OUT/machine.txt"
import torch
assert torch.cuda.is_available(), "no CUDA device: this check needs a GPU"
print(torch.cuda.get_device_name(0), "| torch", torch.__version__, "| CUDA", torch.version.cuda)
PY

status=0
start=$(date +%s)
timeout 240 python -m pytest -q -p no:cacheprovider tests/engine/test_cuda.py 2>&1 | tee "$OUT/tests.txt" || status=1
echo "tests: $(( $(date +%s) - start )) s"

timeout 210 python -m ace_mw.engine.bench --device cuda --dtype bfloat16 --peer-dtype bfloat16 \
    --algorithms baseline eagle_2 eagle_3 ngram --prompts-per-category 3 --max-new-tokens 96 \
    --temperature 0 --out "$OUT/bench" 2>&1 | tail -n 40 || status=1
echo "total: $(( $(date +%s) - start )) s"
exit $status
