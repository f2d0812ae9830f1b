#!/usr/bin/env bash
# GPU check of kill -9 + resume on the embedded default (tiny base, 8 tenants, swap mode), on the device machine:
# the wheels of ../shared/tools/device_wheels.sh in .whl/ and the tiny base folder in .carry/tiny-base are carried;
# results go to $OUT. Two uninterrupted runs, then one killed once metrics.jsonl shows step 5 and resumed.
set -u
export PYTHONPATH=/tmp/site
[ -d /tmp/site/ray ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -1
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
ARGS="+tenants=8 trainer.policy.model.path=.carry/tiny-base preset=demo clora.device=cuda clora.progress=false trainer.max_training_steps=10 trainer.ckpt_interval=2"
for run in a b; do
  /usr/bin/time -f "$run wall %e s" python3 -m skyrl_clora.main $ARGS clora.output_dir=$OUT/$run 2>&1 | tail -2
done
python3 -m skyrl_clora.main $ARGS clora.output_dir=$OUT/c > $OUT/c.log 2>&1 &
pid=$!
until grep -q '"step": 5' $OUT/c/metrics.jsonl 2>/dev/null; do sleep 0.2; done
kill -9 $pid; wait $pid; echo "killed: $?"
python3 -m skyrl_clora.main $ARGS clora.output_dir=$OUT/c 2>&1 | tail -2
python3 - <<'PY'
import json, os
out = os.environ["OUT"]
def recs(run):
    by = {}
    for line in open(f"{out}/{run}/metrics.jsonl"):
        r = json.loads(line)
        r = {k: v for k, v in r.items() if not k.endswith("_s") and "time" not in k and "pass_tenants" not in k}
        by.setdefault(r["tenant"], []).append(r)
    return by
a, b, c = recs("a"), recs("b"), recs("c")
print("a vs b identical:", a == b, "| a vs c (killed at step 5, resumed) identical:", a == c)
for name, x, y in (("b", a, b), ("c", a, c)):
    diff = [(t, i, k) for t in x for i, (p, q) in enumerate(zip(x[t], y[t])) for k in p if p.get(k) != q.get(k)]
    print(name, "differing entries:", len(diff), diff[:3])
PY
