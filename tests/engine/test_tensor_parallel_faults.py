"""One request cannot take a tensor-parallel group down: a fault on any rank inside an
announced step (before its forward, inside it between two collectives, or after it) fails
only the requests it can be blamed on, the other requests give the tokens of a clean run,
and the same follower process keeps serving.

Faults are injected in the follower process too: a sitecustomize module on the follower's
PYTHONPATH wraps ModelRunner.replay there, and reads the poison plan from a file each step,
so one group serves every generated example.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from folio.worker import LLM, SamplingParams
from conftest import run_all

ENGINE = dict(block_size=4, num_kv_blocks=24, num_cpu_blocks=24, max_model_len=128, max_num_batched_tokens=32,
              preemption_mode="auto", max_num_seqs=8, tensor_parallel_size=2, enable_prefix_caching=False)
MARKER = 1000  # request i's prompt holds token MARKER + i (other prompt tokens are < 300)

POISON = '''
import json, os


class Poison(RuntimeError):
    pass


def poisoned(runner, run, input_ids, positions):
    """run() unless this step holds a (token, position) pair the plan poisons on this rank;
    then raise before, inside (at the step's 4th all-reduce) or after it."""
    with open(os.environ["FOLIO_TEST_TP_POISON"]) as f:
        plan = json.load(f)
    group = runner.model.group
    pairs = set(zip(input_ids.tolist(), positions.tolist()))
    hit = [(t, p, where) for t, p, where in plan.get(str(group.rank), []) if (t, p) in pairs]
    if not hit:
        return run()
    token, _, where = hit[0]
    with open(plan["fired"], "a") as f:
        f.write(f"{group.rank} {token} {where}\\n")
    why = Poison(f"poisoned on rank {group.rank} {where} its step (token {token})")
    if where == "before":
        raise why
    if where == "after":
        run()
        raise why
    real, count = group.all_reduce, [0]

    def all_reduce(x):
        count[0] += 1
        if count[0] == 4:
            raise why
        return real(x)
    group.all_reduce = all_reduce
    try:
        return run()
    finally:
        del group.all_reduce


def install():
    import folio.worker.model_runner as mr

    real = mr.ModelRunner.replay

    def replay(self, tensors, batches):
        return poisoned(self, lambda: real(self, tensors, batches), tensors["input_ids"], tensors["positions"])
    mr.ModelRunner.replay = replay
'''


@pytest.fixture(scope="module")
def tp(model_dirs, tmp_path_factory):
    """A TP=2 engine whose follower and rank 0 both read the poison plan at `plan` each step."""
    d = tmp_path_factory.mktemp("tp_poison")
    (d / "tp_poison.py").write_text(textwrap.dedent(POISON))
    (d / "sitecustomize.py").write_text("import os\nif os.environ.get('FOLIO_TEST_TP_POISON'):\n"
                                        "    import tp_poison\n    tp_poison.install()\n")
    plan, fired = d / "plan.json", d / "fired.txt"
    plan.write_text(json.dumps({"fired": str(fired)}))
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "FOLIO_TEST_TP_POISON")}
    os.environ["PYTHONPATH"] = os.pathsep.join([str(d)] + ([saved["PYTHONPATH"]] if saved["PYTHONPATH"] else []))
    os.environ["FOLIO_TEST_TP_POISON"] = str(plan)
    sys.path.insert(0, str(d))
    import tp_poison

    try:
        llm = LLM(model_dirs["llama"], **ENGINE)
        runner = llm.engine.runner
        real_execute = runner.execute

        def execute(inputs, batches=None):  # rank 0's share, in this process
            return tp_poison.poisoned(runner, lambda: real_execute(inputs, batches), inputs.input_ids,
                                      inputs.positions)
        runner.execute = execute
        yield llm.engine, plan, fired
        runner.close()
    finally:
        sys.path.remove(str(d))
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


request = st.fixed_dictionaries({
    "prompt": st.lists(st.integers(3, 300), min_size=1, max_size=40),
    "marker_at": st.integers(0, 40),  # where the request's marker token goes (clamped to the prompt)
    "max_tokens": st.integers(1, 8),
    "poison": st.one_of(st.none(), st.tuples(st.sampled_from(["0", "1", "both"]),
                                             st.sampled_from(["before", "inside", "after"]))),
})


@settings(max_examples=15, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(reqs=st.lists(request, min_size=2, max_size=6))
def test_a_fault_on_any_rank_fails_only_its_request_and_the_group_keeps_serving(tp, reqs):
    engine, plan, fired = tp
    followers = [f.pid for f in engine.runner.followers]
    batch, poisons = [], {}
    for i, r in enumerate(reqs):
        at = min(r["marker_at"], len(r["prompt"]))
        prompt = r["prompt"][:at] + [MARKER + i] + r["prompt"][at:]
        batch.append((f"r{i}", prompt, SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True)))
        if r["poison"] is not None:
            ranks, where = r["poison"]
            for rank in (["0", "1"] if ranks == "both" else [ranks]):
                poisons.setdefault(rank, []).append([MARKER + i, at, where])
    fired.write_text("")
    plan.write_text(json.dumps({"fired": str(fired), **poisons}))
    got = run_all(engine, batch)
    hit = {f"r{int(line.split()[1]) - MARKER}" for line in fired.read_text().split("\n") if line}
    plan.write_text(json.dumps({"fired": str(fired)}))
    expect = run_all(engine, [b for b in batch if b[0] not in hit])
    assert hit == {f"r{i}" for i, r in enumerate(reqs) if r["poison"] is not None}  # every poison was reached
    for line in fired.read_text().split("\n"):
        if line:
            event(f"fired on rank {line.split()[0]} {line.split()[2]} its step")
    for rid, out in got.items():
        if rid in hit:
            assert out.error and "Poison" in out.error and "tensor-parallel group" in out.error, out
            assert all(c.finish_reason == "error" for c in out.outputs)
        else:
            assert out.error is None, out.error
            assert out.outputs[0].token_ids == expect[rid].outputs[0].token_ids, rid
    assert [f.pid for f in engine.runner.followers] == followers
    assert all(f.poll() is None for f in engine.runner.followers)  # the same follower, still serving
    assert engine.runner.group.broken is None and engine.runner.healthy()
