"""A against B for two states of the code, alternated (A B B A ...): one benchmark command run
with the files of a git revision (A) and with the work tree's (B), each run in fresh processes.

    python benchmarks/code_ab.py --base HEAD --files worker/actor.py,worker/outbox.py \
        --rounds 2 --out benchmarks/results/code_ab.json -- \
        python benchmarks/frontend_overhead.py --model models/tiny-llama-8l --requests 100 --out {out}

`folio` is installed editable from this checkout, so the files are swapped in place: the
work tree's copies are kept aside and put back when the script ends, however it ends. A
file the base lacks is left in place (code that no longer imports it does not see it).
`{out}` in the command becomes a per-run JSON path; each run's JSON goes into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True, help="the git revision whose files are A")
    ap.add_argument("--files", required=True, help="comma-separated paths that differ")
    ap.add_argument("--rounds", type=int, default=2, help="each round is A B B A")
    ap.add_argument("--out", required=True)
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    files = [f for f in args.files.split(",") if f]
    tmp = tempfile.mkdtemp(prefix="folio-code-ab-")
    saved = {}
    for f in files:
        saved[f] = os.path.join(tmp, f.replace("/", "__"))
        shutil.copy2(os.path.join(ROOT, f), saved[f])
    base = {}
    for f in files:
        r = subprocess.run(["git", "show", f"{args.base}:{f}"], cwd=ROOT, capture_output=True)
        base[f] = r.stdout if r.returncode == 0 else None

    def put(state: str) -> None:
        for f in files:
            if state == "B":
                shutil.copy2(saved[f], os.path.join(ROOT, f))
            elif base[f] is not None:
                with open(os.path.join(ROOT, f), "wb") as fh:
                    fh.write(base[f])

    runs = []
    try:
        for rnd in range(args.rounds):
            for i, state in enumerate("ABBA"):
                put(state)
                out = os.path.join(tmp, f"run-{rnd}-{i}-{state}.json")
                t0 = time.time()
                rc = subprocess.run([c.replace("{out}", out) for c in cmd], cwd=ROOT).returncode
                result = json.load(open(out)) if os.path.exists(out) else None  # (rc 1: a target missed)
                runs.append({"state": state, "round": rnd, "rc": rc, "wall_s": round(time.time() - t0, 1),
                             "result": result})
                print(f"code_ab: round {rnd} {state} rc {rc}", flush=True)
    finally:
        put("B")
        shutil.rmtree(tmp, ignore_errors=True)
    doc = {"benchmark": "code_ab", "date": time.strftime("%Y-%m-%d %H:%M:%S"), "base": args.base,
           "files": files, "command": " ".join(cmd), "cpus": os.cpu_count(), "runs": runs}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print("wrote", args.out)
    return 0 if all(r["rc"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
