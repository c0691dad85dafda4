"""The pure core imports neither torch nor Ray: the engine's configuration, the block
manager, the scheduler, the wire types and the cluster's policies load in milliseconds and can be tested without either.
Each check runs in a fresh interpreter (this one has imported torch through conftest)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PURE = ["folio.worker.config", "folio.worker.block_manager", "folio.worker.block_pool", "folio.worker.scheduler", "folio.worker.sequence",
        "folio.worker.messages", "folio.worker.sampling_params", "folio.worker.hashing", "folio.worker.preemption",
        "folio.cluster.policies", "folio.cluster.placement"]
HEAVY = ["torch", "ray", "transformers", "triton", "numpy", "folio.kernels", "folio.worker.engine"]


def loaded_after(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code + f"\nimport sys, json; print(json.dumps({{m: m in sys.modules "
                          f"for m in {HEAVY!r}}}))"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_pure_core_loads_without_torch_or_ray():
    got = loaded_after("import " + ", ".join(PURE))
    assert not any(got.values()), {m for m, v in got.items() if v}


@pytest.mark.parametrize("module", PURE)
def test_each_pure_module_alone(module):
    got = loaded_after(f"import {module}")
    assert not any(got.values()), (module, {m for m, v in got.items() if v})


def test_the_package_names_still_resolve_and_load_the_engine_only_when_asked():
    got = loaded_after("import folio.worker as w\nassert 'LLM' in dir(w) and 'LLMEngine' in w.__all__\n"
                       "from folio.worker import SamplingParams\nassert SamplingParams(max_tokens=3).max_tokens == 3")
    assert not got["torch"] and not got["folio.worker.engine"]
    got = loaded_after("from folio.worker import LLM, LLMEngine, EngineConfig, RequestOutput\n"
                       "import folio.worker as w\nassert w.LLM is LLM")
    assert got["torch"] and got["folio.worker.engine"]


def test_an_unknown_name_is_an_attribute_error():
    import folio.worker

    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        folio.worker.Nope  # noqa: B018
    with pytest.raises(ImportError):
        exec("from folio.worker import Nope", {})
