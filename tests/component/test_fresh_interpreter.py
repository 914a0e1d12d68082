"""What needs a fresh interpreter to see: the light paths (checking a data source, resolving a builtin reward, checking
a model path) import no heavy library, and a thread abandoned mid-call does not keep its process from exiting. Each
test runs one `python -c` child."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.unit.test_data import ROWS, write_jsonl

pytestmark = pytest.mark.timeout(60)


def test_preflight_imports_nothing_heavy(tmp_path):
    write_jsonl(tmp_path / "d.jsonl", ROWS)
    code = (
        "import sys\n"
        "from asyncgrpo.data.loading import check_data_source\n"
        f"check_data_source('builtin:addition'); check_data_source({str(tmp_path / 'd.jsonl')!r})\n"
        "heavy = [m for m in ('torch', 'transformers', 'datasets', 'pyarrow') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)


def test_resolve_builtin_does_not_import_heavy_libraries():
    code = (
        "import sys\n"
        "from asyncgrpo.rewards.resolve import resolve_reward\n"
        "resolve_reward('builtin:repeat_letter', 0)\n"
        "heavy = [m for m in ('torch', 'transformers', 'datasets', 'pyarrow') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)


def test_check_model_path_imports_no_torch():
    code = (
        "import sys; from asyncgrpo.models.loading import check_model_path; check_model_path('builtin:tiny'); "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'heavy import'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_hung_call_does_not_keep_the_process_from_exiting():
    script = textwrap.dedent("""
        import asyncio, threading
        from asyncgrpo.threads import DaemonThreadPool

        async def main():
            pool = DaemonThreadPool(2, name="t")
            async with pool.worker() as thread:
                await thread.call(lambda: None)  # an idle thread, left unclosed
            try:
                async with asyncio.timeout(0.05):
                    async with pool.worker() as thread:
                        await thread.call(threading.Event().wait)  # never returns
            except TimeoutError:
                print("abandoned", flush=True)

        asyncio.run(main())
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=20)
    assert done.returncode == 0 and done.stdout == "abandoned\n", done.stderr
