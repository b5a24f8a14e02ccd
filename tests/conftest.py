"""Shared fixtures. The Ray cluster is real: started once per test session on 127.0.0.1 (see draftline.raycluster)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Callable

import pytest

from draftline.utils import free_port  # noqa: F401 - tests import it from here

REPO = Path(__file__).resolve().parents[1]


def load_script(relative: str):
    """A script of the repository that is not a package module (benchmarks/, scripts/), imported by its path."""
    path = REPO / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# A bench of a few short prompts: real accept length, speedup and losslessness in seconds (add bench.concurrency).
SMALL_BENCH = ["bench.num_prompts=4", "bench.max_new_tokens=16"]

# The gate's wall-clock speedup floor in the whole-pipeline tests. The speedup is a measurement, not those tests'
# subject (tests/integration/test_gate_runs.py checks the verdicts): on the Ray-job pipeline, two rounds gave 0.59x
# [0.33, 0.91] at load 15-20 and [0.25, ...] at load 30-55 for a drafter whose accept length is above 2; the kimi-k2.5
# twin's four short prompts gave 0.84x [0.39, 1.85] at load ~11 (full13), inconclusive against 0.5x. 0.2x still
# fails a pathologically slow speculative engine.
PIPELINE_TEST_MIN_SPEEDUP = 0.2

# vLLM's CPU build in tests: --enforce-eager skips torch.compile (minutes of start-up), one OpenMP thread per server
# (the servers share a 2-core machine).
VLLM_TEST_OVERRIDES = [
    "engine.backend=vllm", "engine.vllm.enforce_eager=true", "engine.vllm.cpu_threads=1",
    "engine.vllm.max_model_len=512",
]


def start_session_ray() -> None:
    """The test session's local Ray (also started again after a test that needed a cluster of its own)."""
    from draftline.raycluster import ensure_ray

    # 4 logical CPUs on a 2-core machine: Ray Train needs a CPU for its controller besides 2 workers.
    ensure_ray(num_cpus=int(os.environ.get("DRAFTLINE_TEST_RAY_CPUS", "4")))


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    start_session_ray()
    yield ray
    ray.shutdown()


CPUACCT_ROOT = Path("/sys/fs/cgroup/cpuacct")  # cgroup v1's CPU accounting, where this machine mounts it


def cpu_meter() -> Callable[[], float]:
    """-> a function giving the CPU seconds spent so far by this test process and everything it started since.

    A cpuacct cgroup of the process's own: its Ray cluster, servers and subprocesses join it as they start, and their
    CPU stays counted after they exit (the raylet ignores SIGCHLD, so a process tree's own counters lose every
    Ray worker that has ended). Needs cgroup v1's cpuacct and the right to create a group in it (root)."""
    group = CPUACCT_ROOT / f"draftline-test-{os.getpid()}"
    try:
        group.mkdir(exist_ok=True)
        (group / "cgroup.procs").write_text(str(os.getpid()))
    except OSError as err:
        raise pytest.UsageError(f"DRAFTLINE_TEST_CPU_LOG needs a cpuacct cgroup of the test process's own, and "
                                f"{group} could not be made or joined ({err}); run as root where cgroup v1's "
                                f"cpuacct is mounted at {CPUACCT_ROOT}, or unset it") from None
    usage = group / "cpuacct.usage"
    return lambda: int(usage.read_text()) / 1e9


_test_cpu: list[Callable[[], float]] = []


def pytest_configure(config):
    """With DRAFTLINE_TEST_CPU_LOG set, each process that runs tests gets its CPU meter (not xdist's controller)."""
    controller = config.pluginmanager.hasplugin("xdist") and config.getoption("numprocesses", None) and not hasattr(
        config, "workerinput")
    if os.environ.get("DRAFTLINE_TEST_CPU_LOG") and not controller:
        _test_cpu.append(cpu_meter())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With DRAFTLINE_TEST_CPU_LOG set: one JSON line per test there, with the CPU seconds its test process and all
    it started spent on it (set-up and teardown of the fixtures it was first or last to use included) and its wall
    seconds. The suite is CPU-bound on 2 cores: this, not the wall time of a test beside another, says what a test
    costs. The group is left behind when the run ends (the Ray processes of a session cluster may outlive pytest's
    last hook); `rmdir` removes it once empty."""
    if not _test_cpu:
        yield
        return
    cpu_before, started = _test_cpu[0](), time.monotonic()
    yield
    record = {"test": item.nodeid, "cpu_s": round(_test_cpu[0]() - cpu_before, 2),
              "wall_s": round(time.monotonic() - started, 2), "worker": os.environ.get("PYTEST_XDIST_WORKER", "")}
    with open(os.environ["DRAFTLINE_TEST_CPU_LOG"], "a") as handle:
        handle.write(json.dumps(record) + "\n")


@pytest.fixture(autouse=True)
def _session_ray_first_in_integration_and_e2e(request):
    """Every test process has the session's Ray (4 logical CPUs) before its first integration or e2e test. Without
    it, a module that started Ray through draftline's own code (extraction, training) first in its process got a Ray
    of the machine's 2 CPUs, which that process's later modules then shared: in full13 a regenerate replica beside a
    served app (1 + 2 x 0.25 CPUs) waited for a CPU until the test's timeout."""
    if request.path.parent.name in ("integration", "e2e"):
        request.getfixturevalue("ray_cluster")


# Tests train with the blocked TTT attention: at test lengths it is the cheaper path per step, and the fused path
# compiles flex attention with inductor in every training process, minutes over the suite's training runs
# (benchmarks/RESULTS.md, "TTT attention compile cost in tests"). The shared short run trains fused and packed
# (train_helpers.shared_short_run), so one real Ray Train + DeepSpeed run covers the production path.
CHEAP_TRAIN_ATTENTION = "train.attention=blocked"

# A smaller embedded target for tests: still a real trained LM, built in about a minute (idle machine) by
# tests/prebuild.py before pytest starts, cached across test runs.
TEST_OVERRIDES = [
    "target.embedded.num_layers=8",
    "target.embedded.hidden_size=96",
    "target.embedded.intermediate_size=256",
    "target.embedded.train_steps=150",
    "target.embedded.num_conversations=200",
    "target.embedded.reply_max_new_tokens=40",
    "data.draft_vocab_size=512",
    # Held-out benchmarks cost a pip download per fresh data dir; the tests that check them turn them on.
    "data.held_out_benchmarks=[]",
    CHEAP_TRAIN_ATTENTION,
]


TEST_CONFIG = REPO / "configs" / "tiny-cpu.yaml"


def shared_data_dir() -> str:
    """The shared test data dir: cached test targets, twins and datasets."""
    return os.environ.get("DRAFTLINE_TEST_DATA_DIR", str(REPO / ".draftline-test"))


def config_overrides(data_dir: str | Path | None = None, extra: list[str] | None = None) -> list[str]:
    """The dotted overrides of the test config (also as `draftline ... --config TEST_CONFIG KEY=VALUE...`)."""
    return TEST_OVERRIDES + [f"data_dir={data_dir or shared_data_dir()}"] + list(extra or [])


def make_test_config(data_dir: str | Path | None = None, extra: list[str] | None = None):
    from draftline.config import load_config

    return load_config(TEST_CONFIG, config_overrides(data_dir, extra))


# Twins trained smaller than their configs (the embedded default's recipe), as TEST_OVERRIDES does for the default:
# enough to pass test_twins.py's perplexity bounds (the MoE twin needs the 300 steps: 150 left it at 103.5), in about
# a minute each; their replies are far less varied than those of a twin built from its config (benchmarks/families.py).
TWIN_TEST_OVERRIDES = [
    "target.embedded.train_steps=300", "target.embedded.train_batch_size=8", "target.embedded.train_seq_len=64",
    "target.embedded.num_conversations=160", "target.embedded.reply_max_new_tokens=32", CHEAP_TRAIN_ATTENTION,
]


TWINS = sorted(p.stem for p in (REPO / "configs" / "twins").glob("*.yaml"))
# Production config of each twin -> the published model's class, rope type and head ratio (from its config.json).
PRODUCTION = {
    "llama3.1-8b-4xgpu": {"architecture": "LlamaForCausalLM", "rope_type": "llama3", "gqa": 32 // 8},
    "qwen3-8b": {"architecture": "Qwen3ForCausalLM", "rope_type": "default", "gqa": 32 // 8},
    "qwen3-30b-a3b": {"architecture": "Qwen3MoeForCausalLM", "rope_type": "default", "gqa": 32 // 4},
    "kimi-k2.5": {"architecture": "DeepseekV3ForCausalLM", "rope_type": "yarn", "gqa": 1},
    # Gemma 3 ropes per layer type (rope_parameters has no single rope_type) and ties its embeddings.
    "gemma3-1b": {"architecture": "Gemma3ForCausalLM", "rope_type": "default", "gqa": 4 // 1, "tied": True},
    "gpt-oss-20b": {"architecture": "GptOssForCausalLM", "rope_type": "yarn", "gqa": 64 // 8},
}


def twin_config_path(name: str) -> Path:
    return REPO / "configs" / "twins" / f"{name}.yaml"


def twin_overrides(extra: list[str] | None = None) -> list[str]:
    """The dotted overrides of a twin's config in tests: the shared test data dir (twins are cached there by hash)."""
    return [f"data_dir={shared_data_dir()}", *TWIN_TEST_OVERRIDES, *(extra or [])]


def twin_config(name: str, extra: list[str] | None = None):
    from draftline.config import load_config

    return load_config(twin_config_path(name), twin_overrides(extra))


def bench_prompts(cfg, target_dir, count: int) -> list[list[int]]:
    """The first `count` prompts of the bench split (token ids up to the first trained token)."""
    from draftline.data.prepare import load_split, prepare

    samples = load_split(prepare(cfg, target_dir), "bench")
    return [s["input_ids"][: s["loss_mask"].index(1)] for s in samples if 1 in s["loss_mask"]][:count]


def prompt_past_window(cfg, target_dir, window: int) -> list[int]:
    """Bench prompts one after the other until the prompt is three attention windows long."""
    ids: list[int] = []
    for prompt in bench_prompts(cfg, target_dir, 16):
        ids += prompt
        if len(ids) >= 3 * window:
            return ids
    raise AssertionError(f"the bench prompts of {target_dir} add up to {len(ids)} tokens, under 3 windows of {window}")


@pytest.fixture(scope="session")
def tiny_cfg():
    return make_test_config()


@pytest.fixture(scope="session")
def tiny_target_dir(tiny_cfg):
    from draftline.target.bootstrap import bootstrap_target

    return bootstrap_target(tiny_cfg)


@pytest.fixture(scope="session")
def tiny_dataset_dir(tiny_cfg, tiny_target_dir):
    from draftline.data.prepare import prepare

    return prepare(tiny_cfg, tiny_target_dir)


FITTED_DRAFTER_STEPS = 200


@pytest.fixture(scope="session")
def fitted_drafter_dir(tiny_cfg, tiny_target_dir, tiny_dataset_dir):
    """A drafter fitted in-process (`quick_drafter`, cached on disk; tests/prebuild.py builds it before the session):
    most drafts are accepted."""
    from draftline.bench.quick_drafter import quick_drafter

    return quick_drafter(tiny_cfg, tiny_target_dir, tiny_dataset_dir, steps=FITTED_DRAFTER_STEPS)


@pytest.fixture(scope="session")
def short_offline_run(ray_cluster, tiny_cfg, tiny_target_dir, tiny_dataset_dir):
    """(cfg, hidden_dir, TrainResult): a 6-step 2-worker Ray Train + DeepSpeed run on the test target's shards,
    trained once per test data dir (train_helpers.shared_short_run)."""
    from train_helpers import shared_short_run

    return shared_short_run(tiny_cfg, tiny_target_dir, tiny_dataset_dir)


@pytest.fixture(scope="session")
def random_drafter_dir(tmp_path_factory, tiny_target_dir):
    """An export of a randomly initialised drafter for the test target: almost every draft is rejected."""
    from draftline.drafter.export import export_drafter
    from registry_helpers import random_drafter

    return export_drafter(random_drafter(tiny_target_dir, draft_vocab_size=512, seed=3), tmp_path_factory.mktemp("rnd"))


# The real pretrained target (SmolLM2-135M-Instruct from its pinned wheel, configs/smollm2-135m-cpu.yaml), at the
# tests' size: a few dozen of draftline's own prompts answered by the target on the reference engine, a short train.
REAL_CONFIG = REPO / "configs" / "smollm2-135m-cpu.yaml"
REAL_TEST_OVERRIDES = [
    "data.prompt_source.count=40", "regenerate.limit=16", "regenerate.max_new_tokens_per_turn=48",
    "regenerate.engine.backend=reference", "regenerate.requests_in_flight=8", "regenerate.conversations_per_shard=16",
    "data.max_seq_len=192", "data.split.val_fraction=0.15", "data.split.bench_fraction=0.0",
    "data.draft_vocab_size=2048", "extract.batch_size=4", "train.num_workers=1", "train.max_steps=30",
    "train.micro_batch_size=4", "train.warmup_steps=3", "train.lr=0.003", "train.val_every=30",
    "train.checkpoint_every=30", "engine.backend=reference", "bench.num_prompts=3", "bench.max_new_tokens=24",
    "bench.rounds=1", "bench.concurrency=[1]", CHEAP_TRAIN_ATTENTION,
]


def real_config(extra: list[str] | None = None):
    from draftline.config import load_config

    return load_config(REAL_CONFIG, [f"data_dir={shared_data_dir()}", *REAL_TEST_OVERRIDES, *(extra or [])])


@pytest.fixture(scope="session")
def real_target_dir():
    """The real target imported once per session (and cached by hash in the shared test data dir across sessions)."""
    from draftline.target.bootstrap import bootstrap_target

    return bootstrap_target(real_config())


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny matmuls gain nothing from threads and suffer badly from oversubscription on a shared 2-core box."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def one_mb_tmpfs(tmp_path):
    """A real 1 MB file system, so writers hit a real ENOSPC (needs root with CAP_SYS_ADMIN, else skipped; each stage
    has an in-process test that injects the error without it). `mount -o remount,size=...` frees space."""
    mount_point = tmp_path / "tmpfs"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount_point)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    yield mount_point
    subprocess.run(["umount", str(mount_point)], check=True)
