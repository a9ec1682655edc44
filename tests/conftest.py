"""Session-wide hygiene: no test may leave engine processes or shared memory behind."""

from __future__ import annotations

import multiprocessing
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/dataplane_util.py

#: ZeroMQ contexts the garbage collector found unclosed (counted at the end of the run).
UNCLOSED_CONTEXTS: list[str] = []


def _unclosed_contexts_do_not_hang() -> None:
    """pyzmq destroys a context collected unclosed (``Context.__del__``: ``destroy``, then
    ``term``). When its sockets are garbage in the same cycle, their weak references are
    cleared first: ``destroy`` closes none of them and ``term`` waits for them forever,
    hanging the test process in whatever test the collector happens to run (seen once
    under pytest-xdist, in a worker whose earlier modules left such a cycle). In the tests
    such a context is left to the process's exit instead, and counted at the end."""
    from zmq.sugar.context import Context

    def __del__(self) -> None:
        if not self._shadow and not self.closed:
            UNCLOSED_CONTEXTS.append(f"{type(self).__name__} at {id(self):#x}")

    Context.__del__ = __del__


_unclosed_contexts_do_not_hang()


def pytest_report_header(config) -> list[str]:
    """What the machine offers (also at the end, beside the slowest tests): a run's times
    mean little without it."""
    try:
        from tokenlake.kernels import native

        native.load()  # builds the kernels where they are not (make test has built them)
        m = native.machine_info()
        cpu, cores, isa = m["cpu"], m["cores"], m["isa"] + (" (bf16 dots)" if m["bf16_dots"] else "")
    except Exception as exc:  # the header never fails the run
        cpu, cores, isa = "?", len(os.sched_getaffinity(0)), f"? ({type(exc).__name__})"
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return [f"machine: {cpu}, {cores} cores usable, isa {isa}, load {load}"]


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if UNCLOSED_CONTEXTS:
        terminalreporter.write_line(f"ZeroMQ contexts collected unclosed (left to the exit): "
                                    f"{len(UNCLOSED_CONTEXTS)}", yellow=True)
    terminalreporter.write_line(pytest_report_header(config)[0])


@pytest.fixture(scope="session", autouse=True)
def credentials_home(tmp_path_factory):
    """Credentials files of served pools go to a directory of this session, never to the
    user's ~/.tokenlake (child processes inherit the variable)."""
    old = os.environ.get("TOKENLAKE_HOME")
    home = tmp_path_factory.mktemp("tokenlake-home")
    os.environ["TOKENLAKE_HOME"] = str(home)
    yield home
    if old is None:
        os.environ.pop("TOKENLAKE_HOME", None)
    else:
        os.environ["TOKENLAKE_HOME"] = old
    leftover = sorted(p.name for p in home.iterdir())
    assert not leftover, f"credentials files left behind: {leftover}"


#: Modules that run first under pytest-xdist, longest first (``make test`` runs two
#: workers): a worker left with one of them at the end would keep the other one idle.
LONG_MODULES = ("test_ray", "test_vllm_query", "test_vllm_connector", "test_bench_restart",
                "test_restart_serve", "test_restart", "test_engine_faults", "test_http",
                "test_shared_pool", "test_demo")


def module_group(nodeid: str) -> str:
    """What runs whole on one pytest-xdist worker: a test module (its module fixtures
    start once), or all the Ray modules (they share one local Ray: ray_util)."""
    stem = Path(nodeid.split("::", 1)[0]).stem
    return "test_ray" if stem.startswith("test_ray") else stem


def pytest_collection_modifyitems(config, items) -> None:
    """Under pytest-xdist the long modules go first (:data:`LONG_MODULES`; the
    controller hands the groups out in this order, ``--no-loadscope-reorder``)."""
    if _xdist(config):
        order = {name: k for k, name in enumerate(LONG_MODULES)}
        items.sort(key=lambda item: order.get(module_group(item.nodeid), len(order)))  # stable


class _ModuleGroups:
    """pytest-xdist's scheduler for :func:`module_group` (registered where pytest-xdist
    is installed; ``--dist loadgroup`` itself reads ``xdist_group`` marks, which it
    cannot apply to pytest 9's items)."""

    @staticmethod
    def pytest_xdist_make_scheduler(config, log):
        from xdist.scheduler import LoadScopeScheduling

        class ModuleGroups(LoadScopeScheduling):
            def _split_scope(self, nodeid: str) -> str:
                return module_group(nodeid)

        return ModuleGroups(config, log)

    @staticmethod
    def pytest_testnodedown(node, error) -> None:
        """A worker's unclosed contexts, counted where the summary is written."""
        UNCLOSED_CONTEXTS.extend(getattr(node, "workeroutput", {}).get("unclosed_contexts", []))


def pytest_configure(config) -> None:
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_ModuleGroups(), "tokenlake-module-groups")


def _xdist(config) -> bool:
    """Whether this run is distributed (on the controller and on each worker)."""
    return getattr(config.option, "dist", "no") != "no" or hasattr(config, "workerinput")


def pytest_sessionstart(session) -> None:
    if _xdist(session.config) and not hasattr(session.config, "workerinput"):
        from tokenlake.dataplane.shm_files import list_buffers

        session.config.stash[_BUFFERS] = set(list_buffers(fifos=True))


@pytest.hookimpl(trylast=True)  # after pytest-xdist has stopped its workers
def pytest_sessionfinish(session, exitstatus) -> None:
    """The controller of a distributed run checks the shared memory once every worker
    has ended (a worker cannot: another one's engines may be between a kill and its
    clean-up); a worker hands it its unclosed contexts."""
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["unclosed_contexts"] = list(UNCLOSED_CONTEXTS)
    before = session.config.stash.get(_BUFFERS, None)
    if before is None:
        return
    leaked = _leaked(before)
    if leaked:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        reporter.write_line(f"\nshared memory left behind: {leaked}", red=True)  # after xdist's progress
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


_BUFFERS = pytest.StashKey[set]()


@pytest.fixture(scope="session", autouse=True)
def no_leftovers(request):
    from tokenlake.dataplane.shm_files import list_buffers

    before = set(list_buffers(fifos=True))
    yield
    children = [p for p in multiprocessing.active_children() if p.name.startswith("tokenlake-")]
    assert not children, f"engine processes still running after the tests: {children}"
    if _xdist(request.config):
        return  # the controller checks the buffers (pytest_sessionfinish)
    leaked = _leaked(before)
    assert not leaked, f"shared memory left behind: {leaked}"


def _leaked(before: set[str]) -> list[str]:
    """This run's buffers that are still there, of the ones made since ``before``."""
    from tokenlake.dataplane.shm_files import list_buffers

    return sorted(name for name in set(list_buffers(fifos=True)) - before if _ours_or_orphaned(name))


def _ours_or_orphaned(name: str) -> bool:
    """A buffer ``tokenlake-<creator pid>-...`` is this session's leak if this process
    created it, or if its creator is gone (a Ray host actor, a crashed engine). Buffers
    of another live process (a second test run on the same machine) are not ours."""
    try:
        pid = int(name.split("-")[1])
    except (IndexError, ValueError):
        return True
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


@pytest.fixture(scope="module")
def kernel():
    """The built csrc module (``native.load``); skips where there is no compiler, and
    fails where g++ and ninja are present but the build did not succeed."""
    import shutil

    from tokenlake.kernels import native

    mod = native.load()
    if mod is None:
        assert shutil.which("g++") is None or shutil.which("ninja") is None, \
            "g++ and ninja are here, so the kernel must build"
        pytest.skip("no compiler: the torch path serves")
    return mod


@pytest.fixture
def isas(kernel):
    """The instruction sets this CPU runs the kernels with, lowest first, for a test to
    force each in turn (``kernel.set_isa``); the best is restored afterwards, also when
    the test fails."""
    order = ["base", "avx2", "avx512", "amx"]
    supported = order[: order.index(kernel.isa()) + 1]
    yield supported
    kernel.set_isa(supported[-1])


@pytest.fixture
def paths(kernel):
    """The many-row paths of the attention kernel, for a test to run each in turn: the
    fewest grouped rows the panel path takes (``kernel.set_panel_rows``) as the
    instruction set chooses (0), 1 (every call of head dim 64 or 128 on the panel path)
    and none (every one on the vector path); the default is back afterwards, also when
    the test fails."""
    yield [0, 1, 1 << 30]
    kernel.set_panel_rows(0)


@pytest.fixture(scope="module")
def smollm2():
    """``(weights, tokenizer, reference engine)`` of the shipped model."""
    from tokenlake.model.llama.reference import ReferenceEngine
    from tokenlake.model.llama.tokenizer import load_tokenizer
    from tokenlake.model.llama.weights import load_weights

    weights = load_weights()
    return weights, load_tokenizer(), ReferenceEngine(weights)


@pytest.fixture(scope="module")
def smollm2_hf(smollm2, tmp_path_factory):
    """The shipped model exported as a Hugging Face directory (what vLLM loads)."""
    pytest.importorskip("safetensors")
    from tokenlake.integrations.hf_export import export

    weights, tok, _ = smollm2
    return export(tmp_path_factory.mktemp("smollm2-hf"), weights=weights, tokenizer=tok)


@pytest.fixture(scope="module")
def tiny_llama():
    """``(weights, tokenizer, reference engine)`` of the small random Llama of
    tests/tiny_model.py (SmolLM2's vocab, so the shipped tokenizer serves it); the
    reference keeps its answers for the whole run and checks their margins."""
    from tiny_model import reference, tiny_weights

    from tokenlake.model.llama.tokenizer import load_tokenizer

    weights = tiny_weights()
    return weights, load_tokenizer(), reference(weights)
