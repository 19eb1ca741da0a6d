"""The stand-in's runtime, in real subprocesses started with its environment (activation is
process-wide): the npu device, torch.npu, streams and events, the profiler, HCCL, graph mode, the
import hooks, the launch-script guards and `migrator standin` itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from locations import REPO_ROOT
from migrator_cli import run_cli
from npu_standin import read_op_usage, standin_env


def run_standin(tmp_path: Path, code: str, *, device: str = "cpu", env: dict | None = None, timeout: int = 300,
                name: str = "script.py", args: tuple = ()):
    script = tmp_path / name
    script.write_text(textwrap.dedent(code))
    records = tmp_path / "records"
    run_env = standin_env(device, base={**os.environ, **(env or {})}, record_dir=records)
    proc = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=timeout,
                          env=run_env, cwd=tmp_path)
    return proc, read_op_usage(records)


def test_npu_device_lands_on_the_host(tmp_path):
    proc, usage = run_standin(tmp_path, """
        import torch, torch_npu
        assert torch.npu.__name__ == "torch_npu.npu" and torch_npu.npu is torch.npu
        d = torch.device("npu", 0)
        assert d == torch.device("cpu") and isinstance(d, torch.device) and torch.device("npu:3").type == "cpu"
        x = torch.randn(3, 4).npu()
        assert x.device.type == "cpu" and x.is_npu
        assert torch.zeros(2, device="npu").device.type == "cpu"
        assert torch.ones(2, device="npu:1").device.type == "cpu"
        assert torch.randn(2).to("npu:0").device.type == "cpu" and torch.randn(2).to(0).device.type == "cpu"
        assert x.new_zeros(2, device="npu").device.type == "cpu"
        m = torch.nn.Linear(4, 4).to("npu:0")
        assert next(m.parameters()).device.type == "cpu"
        assert torch.nn.Linear(2, 2).npu().weight.device.type == "cpu"
        g = torch.Generator(device="npu"); g.manual_seed(3)
        assert isinstance(g, torch.Generator)
        with torch.device("meta"):                 # the default-device context still works
            assert torch.empty(2).device.type == "meta"
        with torch.device("npu"):
            assert torch.empty(2).device.type == "cpu"
        with torch.autocast("npu", dtype=torch.bfloat16):
            assert (x @ x.T).dtype == torch.bfloat16
        assert torch.npu.is_available() and torch.npu.device_count() == 16
        assert torch.npu.get_device_name() == "npu stand-in (cpu)"
        free, total = torch.npu.mem_get_info(); assert 0 < free <= total
        torch.npu.set_device("npu:2"); assert torch.npu.current_device() == 2
        assert torch.get_device_module("npu") is torch.npu
        print("ok")
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ok" in proc.stdout
    assert "[npu-standin] active: npu -> cpu" in proc.stderr
    assert usage["device"] == "cpu" and usage["processes"] == 1


def test_transformers_loads_models_correctly_under_the_standin(tmp_path, tiny_checkpoints):
    """transformers sees torch_npu (is_torch_npu_available() is True) and builds its models under
    `with torch.device("meta")`: rotary buffers must still be initialised (a wrapped factory that
    escaped the default-device context left them uninitialised)."""
    checkpoint = tiny_checkpoints("qwen3")
    code = f"""
        import torch, json, sys
        from transformers import AutoModelForCausalLM
        from transformers.utils import is_torch_npu_available
        m = AutoModelForCausalLM.from_pretrained({str(checkpoint)!r}, dtype=torch.float32)
        ids = torch.tensor([[3, 4, 5, 6]])
        print(json.dumps({{"npu": is_torch_npu_available(), "inv_freq": m.model.rotary_emb.inv_freq[:3].tolist(),
                          "logits": m(ids).logits[0, -1, :4].tolist()}}))
    """
    proc, _ = run_standin(tmp_path, code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    under = json.loads(proc.stdout.strip().splitlines()[-1])
    plain = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert plain.returncode == 0, plain.stderr[-2000:]
    outside = json.loads(plain.stdout.strip().splitlines()[-1])
    assert under["npu"] is True and outside["npu"] is False
    assert under["inv_freq"] == pytest.approx(outside["inv_freq"], rel=1e-6)
    assert under["logits"] == pytest.approx(outside["logits"], rel=1e-5, abs=1e-5)


def test_streams_and_events_keep_program_order_on_the_host(tmp_path):
    proc, usage = run_standin(tmp_path, """
        import time, torch
        s = torch.npu.Stream()
        start, end = torch.npu.Event(enable_timing=True), torch.npu.Event(enable_timing=True)
        start.record()
        with torch.npu.stream(s):
            assert torch.npu.current_stream() is s
            y = torch.randn(64, 64) @ torch.randn(64, 64)
            time.sleep(0.02)
        end.record(s)
        assert torch.npu.current_stream() is torch.npu.default_stream()
        s.wait_stream(torch.npu.current_stream()); end.wait(); s.wait_event(end)
        assert end.query() and s.query()
        torch.npu.synchronize()
        ms = start.elapsed_time(end)
        assert 15 <= ms < 5000, ms
        y.record_stream(s)                 # no-op: host streams keep nothing alive
        try:
            torch.npu.Event().elapsed_time(torch.npu.Event())
        except RuntimeError as exc:
            assert "enable_timing" in str(exc)
        else:
            raise AssertionError("timing without enable_timing")
        print("ok")
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert usage["runtime"]["torch.npu.Event.record"] == 2 and usage["runtime"]["torch.npu.synchronize"] == 1


def test_profiler_is_a_no_op_that_says_so(tmp_path):
    proc, usage = run_standin(tmp_path, """
        import os, torch, torch_npu
        called = []
        cfg = torch_npu.profiler._ExperimentalConfig(profiler_level=torch_npu.profiler.ProfilerLevel.Level1,
                                                     aic_metrics=torch_npu.profiler.AiCMetrics.PipeUtilization)
        with torch_npu.profiler.profile(activities=[torch_npu.profiler.ProfilerActivity.NPU,
                                                    torch_npu.profiler.ProfilerActivity.CPU],
                                        schedule=torch_npu.profiler.schedule(wait=0, warmup=0, active=1),
                                        on_trace_ready=lambda p: called.append(p),
                                        experimental_config=cfg) as prof:
            for _ in range(3):
                torch.randn(4) + 1
                prof.step()
        assert prof.step_num == 3 and not called
        print(sorted(f for f in os.listdir(".") if f != "records"))
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "torch_npu.profiler is a no-op on the stand-in: no NPU trace is written" in proc.stderr
    assert proc.stdout.strip() == "['script.py']"           # no trace folder, no files
    assert usage["runtime"]["torch_npu.profiler (no-op)"] == 1


def test_hccl_groups_run_on_gloo_with_upstreams_process_group_options(tmp_path):
    """Two ranks as upstream's function.sh starts them (LOCAL_RANK, fixed MASTER_PORT=6038):
    init_process_group("hccl") and new_group(pg_options=ProcessGroupHCCL.Options()) run on gloo."""
    code = """
        import os, sys, torch, torch_npu, torch.distributed as dist
        rank = int(os.environ["LOCAL_RANK"])
        dist.init_process_group(backend="hccl", world_size=2, rank=rank)
        options = torch_npu._C._distributed_c10d.ProcessGroupHCCL.Options()
        options.hccl_config = {"hccl_buffer_size": 200, "hccl_op_expansion_mode": 3}
        group = dist.new_group([0, 1], pg_options=options)
        t = torch.full((3,), float(rank + 1), dtype=torch.bfloat16, device="npu")
        dist.all_reduce(t, group=group)
        parts = [torch.zeros(2) for _ in range(2)]
        dist.all_gather(parts, torch.full((2,), float(rank)), group=group)
        assert t.tolist() == [3.0] * 3 and [p.tolist() for p in parts] == [[0.0, 0.0], [1.0, 1.0]]
        assert dist.get_backend() == "gloo"
        dist.destroy_process_group()
        print("rank", rank, "ok")
    """
    script = tmp_path / "ranks.py"
    script.write_text(textwrap.dedent(code))
    records = tmp_path / "records"
    procs = []
    for rank in range(2):
        env = standin_env("cpu", base={**os.environ, "LOCAL_RANK": str(rank), "MASTER_ADDR": "192.0.2.99",
                                       "MASTER_PORT": "6038"}, record_dir=records, master_port=_free_port())
        procs.append(subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, env=env))
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    usage = read_op_usage(records)
    assert usage["ranks"] == [0, 1] and usage["runtime"]["hccl->gloo"] == 2
    assert any("hccl_buffer_size=200" in note for note in usage["notes"].values())
    assert "192.0.2.99:6038" in usage["notes"]["rendezvous"]


def _free_port(_cache={}):
    """One port for both ranks of a test (the launcher picks one per run)."""
    from npu_standin.environment import free_port

    if "port" not in _cache:
        _cache["port"] = free_port()
    return _cache["port"]


def test_graph_mode_compiles_with_torch_compile_and_reports_recompiles(tmp_path):
    proc, usage = run_standin(tmp_path, """
        import torch, torch_npu, torchair
        from torchair.configs.compiler_config import CompilerConfig
        config = CompilerConfig()
        config.experimental_config.frozen_parameter = True
        backend = torchair.get_npu_backend(compiler_config=config)
        def step(x, w):
            y, _ = torch_npu.npu_rms_norm(x, w, 1e-6)
            return torch_npu.npu_swiglu(y)
        compiled = torch.compile(step, dynamic=False, fullgraph=True, backend=backend)
        w = torch.ones(8)
        for rows in (2, 2, 3, 4):          # new shapes: recompiles
            x = torch.randn(rows, 8)
            torch.testing.assert_close(compiled(x, w), step(x, w))
        ex = torch.compile(step, dynamic=True, backend="npugraph_ex")
        for rows in (5, 6):
            x = torch.randn(rows, 8)
            torch.testing.assert_close(ex(x, w), step(x, w))
        print("ok")
    """, env={"NPU_STANDIN_COMPILE": "capture"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    compiles = usage["compiles"]
    ge, ex = compiles["step [ge_graph]"], compiles["step [npugraph_ex]"]
    assert ge["mode"] == ex["mode"] == "capture"
    assert ge["compiles"] == 3 and ge["recompiles"] == 2          # rows 2, 3, 4: static shapes
    assert ex["compiles"] == 1 and ex["recompiles"] == 0          # dynamic=True
    assert "step [ge_graph] recompiled (ge_graph -> torch.compile/capture), recompile 2" in proc.stderr


def test_the_compile_record_counts_host_syncs_in_a_captured_graph(tmp_path):
    """A device value read back to the host inside the graph (.item() kept in the graph by
    capture_scalar_outputs, a data-dependent nonzero) is counted per compile and named in a note; a
    graph without one records 0 (a module's float, which dynamo passes as a 0-d input and reads back, is
    a host value); fullgraph is recorded as the capture asked for it."""
    proc, usage = run_standin(tmp_path, """
        import torch, torch_npu
        torch._dynamo.config.capture_scalar_outputs = True
        torch._dynamo.config.capture_dynamic_output_shape_ops = True
        class Clean(torch.nn.Module):          # its float attribute is a host scalar input (0-d, .item()): no sync
            eps = 1e-6
            def forward(self, x):
                return torch_npu.npu_rms_norm(torch_npu.npu_swiglu(x), torch.ones(4), self.eps)[0]
        clean = Clean()
        def synced(x):
            return x * x.sum().item() + torch.nonzero(x > 0).shape[0]
        torch.compile(clean, dynamic=True, fullgraph=True, backend="npugraph_ex")(torch.randn(4, 8))
        torch.compile(synced, dynamic=True, fullgraph=False, backend="npugraph_ex")(torch.randn(4, 8))
        print("ok")
    """, env={"NPU_STANDIN_COMPILE": "capture"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    compiles = usage["compiles"]
    clean, synced = compiles["Clean [npugraph_ex]"], compiles["synced [npugraph_ex]"]
    assert (clean["host_syncs"], clean["fullgraph"]) == (0, True)
    assert synced["host_syncs"] == 2 and synced["fullgraph"] is False, synced
    assert "synced [npugraph_ex]: 2 host sync(s)" in proc.stderr


def test_compiled_code_can_name_the_npu_device(tmp_path):
    """dynamo traces torch.device("npu", 0), device="npu" factories and .to("npu:0") in a
    fullgraph capture (torch's compiler tables are built with the real torch.device class)."""
    proc, _ = run_standin(tmp_path, """
        import torch, torch_npu
        def f(x):
            d = torch.device("npu", 0)
            return x + torch.zeros(x.shape, device="npu") + torch.ones(2, device=d).sum() + x.to("npu:0")
        g = torch.compile(f, backend="eager", fullgraph=True)
        x = torch.randn(2)
        torch.testing.assert_close(g(x), f(x))
        print("ok")
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "ok"


def test_compiled_code_can_ask_the_autocast_state(tmp_path):
    """torch.is_autocast_enabled / get_autocast_dtype, which the stand-in wraps to map "npu" onto the
    host, are constants in a fullgraph capture as the real ones are (transformers 5.0's rotary
    embeddings ask them inside the decode step npugraph_ex compiles); the setters still run."""
    proc, _ = run_standin(tmp_path, """
        import torch, torch_npu
        def f(x):
            if torch.is_autocast_enabled("npu") or torch.is_autocast_enabled(x.device.type):
                return x + 1
            return x * 2 if torch.get_autocast_dtype("cpu") == torch.bfloat16 else x * 3
        g = torch.compile(f, backend="eager", fullgraph=True)
        x = torch.ones(2)
        torch.testing.assert_close(g(x), f(x))
        torch.set_autocast_enabled("npu", True)
        assert torch.is_autocast_enabled("cpu")
        print("ok")
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "ok"


def test_standin_is_inactive_unless_asked_for(tmp_path):
    """Its folder on PYTHONPATH without NPU_STANDIN activates nothing: no torch_npu, no npu device."""
    from npu_standin.environment import pythonpath_dir

    code = textwrap.dedent("""
        import torch
        try:
            import torch_npu
        except ImportError:
            print("no torch_npu")
        try:
            torch.device("npu")
        except RuntimeError:
            print("no npu device")
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("NPU_STANDIN")}
    env["PYTHONPATH"] = os.pathsep.join([str(pythonpath_dir()), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:2] == ["no torch_npu", "no npu device"]
    assert "[npu-standin]" not in proc.stderr


def test_shadowed_sitecustomize_still_runs(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import os\nos.environ['OTHER_SITECUSTOMIZE'] = 'ran'\n")
    proc, _ = run_standin(tmp_path, """
        import os, torch, torch_npu
        print(os.environ.get("OTHER_SITECUSTOMIZE"))
    """, env={"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ran"


def test_unknown_names_fail_with_one_line(tmp_path):
    proc, usage = run_standin(tmp_path, """
        import torch, torch_npu, torchair
        for attempt in (lambda: torch.npu.not_a_thing, lambda: torch_npu.not_a_thing):
            try:
                attempt()
            except AttributeError as exc:
                print("A:", exc)
        try:
            import torch_npu.contrib.transfer_to_npu
        except ImportError as exc:
            print("I:", exc)
        x = torch.randn(2, 3)
        torch_npu.npu_weight_quant_batchmatmul(x)
    """, name="model_code.py")
    assert proc.returncode == 1
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("A: npu stand-in: torch.npu.not_a_thing is not provided (used at model_code.py:")
    assert lines[1].startswith("A: npu stand-in: torch_npu.not_a_thing is not provided")
    assert lines[2].startswith("I: npu stand-in: torch_npu.contrib.transfer_to_npu is not provided")
    assert ("[npu-standin] error: torch_npu.npu_weight_quant_batchmatmul has no reference kernel (called at "
            "model_code.py:13)") in proc.stderr
    assert usage["unsupported"] == [{"name": "torch_npu.npu_weight_quant_batchmatmul", "site": "model_code.py:13"}]


def test_engine_environment_under_the_standin_is_the_host(tmp_path):
    """Our own engine picks the npu under the stand-in; its record says what it really was."""
    proc, _ = run_standin(tmp_path, """
        import json
        from engine.environment import detect_environment
        print(json.dumps(detect_environment("auto")))
    """)
    assert proc.returncode == 0, proc.stderr[-2000:]
    env = json.loads(proc.stdout.strip().splitlines()[-1])
    assert env["device"] == "cpu (npu stand-in)" and env["npu_model"] is None and env["torch_npu_version"] is None
    assert env["npu_standin"]["active"] is True


# ---- launcher guards --------------------------------------------------------------------------
def test_rm_guard_keeps_npu_host_folders_and_removes_the_rest(tmp_path):
    from npu_standin.environment import bin_dir

    kept, other = tmp_path / "atc_data", tmp_path / "scratch"
    for folder in (kept, other):
        (folder / "sub").mkdir(parents=True)
    records = tmp_path / "records"
    env = {**os.environ, "NPU_STANDIN": "cpu", "NPU_STANDIN_KEEP": str(kept), "NPU_STANDIN_RECORD_DIR": str(records),
           "PATH": f"{bin_dir()}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(["bash", "-c", f"rm -rf {kept}/ {other}"], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert kept.is_dir() and not other.exists()
    assert f"kept {kept}/" in (records / "guards.log").read_text()


def test_taskset_guard_runs_a_rank_unpinned_where_the_cpu_list_cannot_be_had(tmp_path):
    from npu_standin.environment import bin_dir

    records = tmp_path / "records"
    env = {**os.environ, "NPU_STANDIN": "cpu", "NPU_STANDIN_RECORD_DIR": str(records),
           "PATH": f"{bin_dir()}{os.pathsep}{os.environ['PATH']}"}
    count = len(os.sched_getaffinity(0))
    too_many = f"{count + 64}-{count + 71}"      # CPUs this host does not have
    proc = subprocess.run(["taskset", "-c", too_many, "echo", "ran"], env=env, capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "ran", proc.stderr
    assert f"taskset -c {too_many}: this host cannot pin" in (records / "guards.log").read_text()
    pinned = subprocess.run(["taskset", "-c", "0", "python3", "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                            env=env, capture_output=True, text=True)
    assert pinned.stdout.strip() == "[0]", pinned.stderr


def test_torchrun_ranks_run_on_the_standin(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(textwrap.dedent("""
        import os, torch, torch.distributed as dist
        dist.init_process_group("hccl")
        t = torch.ones(2, device=f"npu:{os.environ['LOCAL_RANK']}") * (dist.get_rank() + 1)
        dist.all_reduce(t)
        # one write per rank: the two ranks share a pipe, and print() writes its arguments one by one
        os.write(1, f"rank {dist.get_rank()} {t.tolist()} {dist.get_backend()}\\n".encode())
        dist.destroy_process_group()
    """))
    proc = run_cli("standin", "--record", str(tmp_path / "rec"), "--", sys.executable, "-m", "torch.distributed.run",
                   "--standalone", "--nproc_per_node", "2", str(script), cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 0 [3.0, 3.0] gloo" in proc.stdout and "rank 1 [3.0, 3.0] gloo" in proc.stdout
    usage = json.loads((tmp_path / "rec" / "standin_usage.json").read_text())
    assert usage["ranks"] == [0, 1] and usage["runtime"]["hccl->gloo"] == 2
    assert "rendezvous" not in usage["notes"]           # torchrun's agent owns the rendezvous


def test_check_launch_guard_lets_a_cpu_standin_run_start_beside_other_infer_py(tmp_path, upstream_copy):
    """function.sh's check_launch refuses to start while any `python ... infer.py` runs; under a cpu
    stand-in run it has no NPU to protect: it passes, and the record says what it ignored."""
    from npu_standin.environment import bin_dir

    busy = tmp_path / "infer.py"
    busy.write_text("import time\ntime.sleep(60)\n")
    sleeper = subprocess.Popen([sys.executable, str(busy)])
    try:
        function_sh = upstream_copy / "executor" / "scripts" / "function.sh"
        script = f"source {function_sh}; check_launch; echo started"
        plain = subprocess.run(["bash", "-c", script], capture_output=True, text=True)
        assert plain.returncode == 1 and "started" not in plain.stdout
        records = tmp_path / "records"
        env = {**os.environ, "NPU_STANDIN": "cpu", "NPU_STANDIN_RECORD_DIR": str(records),
               "PATH": f"{bin_dir()}{os.pathsep}{os.environ['PATH']}"}
        guarded = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env)
        assert guarded.returncode == 0 and "started" in guarded.stdout, guarded.stdout + guarded.stderr
        assert "other infer.py/server.py process(es) on this host ignored" in (records / "guards.log").read_text()
    finally:
        sleeper.kill()
        sleeper.wait()


# ---- migrator standin -------------------------------------------------------------------------
def test_cli_runs_a_command_and_records_its_kernels(tmp_path):
    script = tmp_path / "use.py"
    script.write_text("import torch, torch_npu\nx = torch.randn(2, 8, device='npu')\n"
                      "torch_npu.npu_rms_norm(x, torch.ones(8))\ntorch_npu.npu_rms_norm(x, torch.ones(8))\n")
    proc = run_cli("standin", "--record", str(tmp_path / "rec"), "--", sys.executable, str(script), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "reference kernels: npu_rms_norm x2" in proc.stderr
    usage = json.loads((tmp_path / "rec" / "standin_usage.json").read_text())
    assert usage["ops"] == {"npu_rms_norm": 2} and usage["device"] == "cpu"


def test_cli_exit_codes(tmp_path):
    assert run_cli("standin").returncode == 2
    missing = run_cli("standin", "--", "no-such-command-xyz")
    assert missing.returncode == 2 and "no-such-command-xyz" in missing.stderr
    (tmp_path / "a_file").write_text("")
    record = run_cli("standin", "--record", str(tmp_path / "a_file"), "--", sys.executable, "-c", "pass")
    assert record.returncode == 2 and "is not a directory" in record.stderr
    import torch

    if not torch.cuda.is_available():
        cuda = run_cli("standin", "--device", "cuda", "--", sys.executable, "-c", "pass")
        assert cuda.returncode == 4 and "torch sees no CUDA device" in cuda.stderr
    script = tmp_path / "bad.py"
    script.write_text("import torch, torch_npu\ntorch_npu.npu_weight_quant_batchmatmul(torch.randn(2))\n")
    bad = run_cli("standin", "--", sys.executable, str(script), cwd=tmp_path)
    assert bad.returncode == 8
    last = bad.stderr.strip().splitlines()[-1]
    assert last == ("migrator: error: torch_npu.npu_weight_quant_batchmatmul has no reference kernel in the npu stand-in "
                    "(first call at bad.py:2)")


def test_cli_refuses_where_a_working_torch_npu_sees_an_npu(tmp_path):
    """The stand-in never shadows a working torch_npu: one that imports and sees NPUs stops it (exit 4)."""
    fake = tmp_path / "site" / "torch_npu"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        "import types, torch\n__version__ = '2.13.0'\n"
        "torch.npu = types.SimpleNamespace(device_count=lambda: 8, is_available=lambda: True)\n")
    proc = run_cli("standin", "--", sys.executable, "-c", "print('ran')", cwd=tmp_path,
                   env={"PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")])})
    assert proc.returncode == 4, proc.stderr
    assert "ran" not in proc.stdout
    assert "a working torch_npu is installed here (torch_npu 2.13.0 sees 8 NPU(s))" in proc.stderr
    assert "never shadows a real NPU" in proc.stderr


@pytest.mark.slow
def test_cli_shadows_the_real_torch_npu_wheel_when_cann_is_missing(tmp_path):
    """torch-npu 2.13.0 installed without CANN does not import (libhccl.so): not a working NPU, so the
    stand-in runs, and its torch_npu is the stand-in's."""
    from npu_wheel import torch_npu_wheel

    folder, why = torch_npu_wheel()
    if folder is None:
        pytest.skip(why)
    proc = run_cli("standin", "--", sys.executable, "-c", "import torch_npu; print(torch_npu.__version__)",
                   cwd=tmp_path, env={"PYTHONPATH": os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")])})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().endswith("+npu.standin")


@pytest.fixture
def upstream_copy(tmp_path):
    import shutil

    source = REPO_ROOT.parent / "shared" / "upstream" / "cann-recipes-infer"
    if not source.is_dir():
        pytest.skip(f"no upstream snapshot at {source} (../shared is absent)")
    target = tmp_path / "cann-recipes-infer"
    shutil.copytree(source, target)
    for path in [target, *target.rglob("*")]:
        path.chmod(path.stat().st_mode | 0o200)
    return target


@pytest.mark.slow
def test_our_own_recipe_runs_under_the_standin_and_its_baseline_says_so(working_recipe, tmp_path):
    import yaml

    config = next((working_recipe / "config").glob("*.yaml"))
    data = yaml.safe_load(config.read_text())
    data["device"] = "npu"                      # the recipe as it would run on an NPU host
    config.write_text(yaml.safe_dump(data))
    proc = run_cli("standin", "--record", str(tmp_path / "rec"), "--", "bash", str(working_recipe / "infer.sh"),
                   cwd=tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log_dir = next((working_recipe / "res").glob("*/*"))
    text = (log_dir / "log_0.log").read_text()
    env_line = next(line for line in text.splitlines() if " environment: {" in line)
    env = json.loads(env_line.split(" environment: ", 1)[1])
    assert env["device"] == "cpu (npu stand-in)" and env["npu_model"] is None
    from agent.measure.baseline import collect

    baseline, _ = collect(str(log_dir), str(config))
    assert baseline["environment"]["device"] == "cpu (npu stand-in)" and "standin" in baseline


def test_record_stream_on_a_host_stream_is_captured_as_nothing(tmp_path):
    """upstream's multi-stream decode (executor/utils/stream_utils: record_stream, events, a side stream)
    in a fullgraph capture: dynamo takes only torch.Stream objects; recording on a host stream keeps
    nothing alive, in a graph too, and the host's program order needs no event inside one."""
    proc, usage = run_standin(tmp_path, """
        import torch, torch_npu
        side = torch.npu.Stream()
        events = [torch.npu.Event(), torch.npu.Event()]
        def step(x):
            y = x * 2
            y.record_stream(side)
            events[0].record()
            with torch.npu.stream(side):
                events[0].wait()
                z = y + 1
                events[1].record()
            events[1].wait()
            return z
        compiled = torch.compile(step, fullgraph=True, backend="npugraph_ex")
        x = torch.randn(3)
        torch.testing.assert_close(compiled(x), x * 2 + 1)
        print("ok")
    """, env={"NPU_STANDIN_COMPILE": "capture"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "nothing to keep alive" in usage["notes"]["captured-record-stream"]
    assert usage["compiles"]["step [npugraph_ex]"]["mode"] == "capture"


def test_the_npugraph_ex_package_is_served_as_torch_npu_npugraph_ex(tmp_path):
    """longcat_flash imports `npugraph_ex` itself: the same compile entry points as torch.npu.npugraph_ex."""
    proc, usage = run_standin(tmp_path, """
        import torch, npugraph_ex
        step = lambda x: x * 3
        compiled = npugraph_ex.inference.cache_compile(step)
        torch.testing.assert_close(compiled(torch.ones(2)), torch.full((2,), 3.0))
        print("ok")
    """, env={"NPU_STANDIN_COMPILE": "capture"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert any(key.endswith("[npugraph_ex]") for key in usage["compiles"])


def test_mixed_dtype_matmul_on_npu_tensors_promotes_as_the_npu_does(tmp_path):
    """bf16 activations into an fp32 weight (upstream's qwen3_moe router, module/linear.py's torch.matmul):
    eager and traced, torch.matmul / `@` / mm / bmm / F.linear without a bias compute in fp32 and return bf16;
    nn.Linear with an fp32 bias is aten's addmm and returns the bias's fp32. Noted in the record."""
    proc, usage = run_standin(tmp_path, """
        import torch, torch_npu
        x = torch.randn(6, 32, dtype=torch.bfloat16).npu()
        w = torch.randn(32, 4, dtype=torch.float32).npu()
        want = (x.float() @ w).to(torch.bfloat16)
        for y in (torch.matmul(x, w), x.matmul(w), x @ w, torch.mm(x, w), x.mm(w)):
            assert y.dtype == torch.bfloat16 and torch.equal(y, want), y.dtype
        assert torch.equal(torch.bmm(x[None], w[None])[0], want)
        assert torch.equal(torch.nn.functional.linear(x, w.T), want)           # aten's linear: matmul path
        gate = torch.nn.Linear(32, 4, dtype=torch.float32).npu()                 # with a bias: addmm path
        assert gate(x).dtype == torch.float32 and torch.equal(gate(x), torch.addmm(gate.bias, x.float(), gate.weight.T))
        compiled = torch.compile(lambda a, b: torch.matmul(a, b).float().softmax(-1), backend="eager", fullgraph=True)
        assert torch.equal(compiled(x, w), want.float().softmax(-1))
        proj = torch.nn.Linear(32, 8, bias=False, dtype=torch.bfloat16).npu()    # equal dtypes: torch's own linear
        traced = torch.compile(lambda a: proj(a) + gate(a).to(torch.bfloat16).sum(-1, keepdim=True), backend="eager",
                               fullgraph=True)                                   # as gemma_4's ge_graph decode step
        assert torch.equal(traced(x), proj(x) + gate(x).to(torch.bfloat16).sum(-1, keepdim=True))
        print("OK")
    """)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]
    assert "computed in torch.float32" in usage["notes"]["matmul-mixed-dtypes"]


def test_an_op_without_reference_in_a_compiled_region_fails_with_the_standins_line(tmp_path):
    """Traced with fullgraph (as a ge_graph decode step is): dynamo reports the stand-in's line as the
    cause, not its own "Attempted to call function marked as skipped" (sys._getframe)."""
    proc, usage = run_standin(tmp_path, """
        import torch, torch_npu
        for fullgraph in (True, False):
            f = torch.compile(lambda x: torch_npu.npu_moe_token_permute(x, x)[0] + 1,
                              backend="eager", fullgraph=fullgraph)
            try:
                f(torch.randn(2, 4).npu())
            except Exception as e:
                print(fullgraph, type(e).__name__, "marked as skipped" in str(e), str(e).replace(chr(10), " "))
    """)
    lines = proc.stdout.splitlines()
    assert len(lines) == 2, proc.stdout + proc.stderr[-2000:]
    want = "npu stand-in: torch_npu.npu_moe_token_permute has no reference kernel"
    assert all(want in line and " False " in line[:30] for line in lines), proc.stdout
    assert "(called at a captured region (torch.compile))" in lines[0]
    assert lines[1].startswith("False UnsupportedOp") and "script.py:" in lines[1]


@pytest.mark.parametrize("probe_first", [True, False], ids=["probe_next_to_standin", "probe_last_on_path"])
def test_the_precision_probe_sees_torch_under_the_standin_whatever_the_path_order(tmp_path, probe_first):
    """Both import hooks on torch fire: the stand-in's wraps torch's loader asking the finders after it, so
    the precision probe's hook (after it or before it on PYTHONPATH) still registers; a bf16 model's record
    names bfloat16 and holds its layers. Without it every stand-in run was judged as float32 (a correct
    bf16 run failed at the floor tolerance) and had no per-layer record."""
    from agent.measure import precision

    probe = precision.probe_env({"PYTHONPATH": os.environ.get("PYTHONPATH", "")}, tmp_path)
    if not probe_first:       # the probe's folder after the stand-in's: the stand-in runs it as the shadowed one
        probe["PYTHONPATH"] = os.pathsep.join(reversed(probe["PYTHONPATH"].split(os.pathsep, 1)))
    proc, _ = run_standin(tmp_path, """
        import types, torch
        class TinyForCausalLM(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.config = types.SimpleNamespace(num_hidden_layers=2)
                self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
                self.head = torch.nn.Linear(8, 16)
            def forward(self, input_ids):
                x = torch.nn.functional.one_hot(input_ids, 8).to(torch.bfloat16)
                for layer in self.layers:
                    x = layer(x)
                return self.head(x)
        model = TinyForCausalLM().to(torch.bfloat16)
        with torch.no_grad():
            model(torch.tensor([[1, 2, 3]]))        # the first call: begun after its forward
            model(input_ids=torch.tensor([[4]]))
    """, env=probe)
    assert proc.returncode == 0, proc.stderr[-2000:]
    import torch

    calls = sorted(precision.record_dir(tmp_path).glob("rank_*/call_*.pt"))
    assert len(calls) == 2, (calls, proc.stderr[-2000:])
    first, second = (torch.load(call, weights_only=False) for call in calls)
    assert (first["phase"], first["input_ids"].tolist(), first["dtype"]) == ("prefill", [1, 2, 3], "bfloat16")
    assert (second["phase"], second["input_ids"].tolist(), second["dtype"]) == ("decode", [4], "bfloat16")
    assert second["layers"] is not None and len(second["layers"]) == 2


def test_a_compiled_step_that_calls_the_model_as_a_module_compiles_once_under_the_precision_probe(tmp_path):
    """An adapter recipe's main_decode calls the wrapped `*ForCausalLM` module inside the compiled step, so
    dynamo traces the probe's hooks on it; the probe's state changes at every eager step (its call count),
    and a hook that touched it while traced made dynamo guard on it: a recompile per decode step until the
    recompile limit failed the fullgraph capture (every adapter recipe's npugraph_ex trial)."""
    from agent.measure import precision

    probe = precision.probe_env({"PYTHONPATH": os.environ.get("PYTHONPATH", "")}, tmp_path)
    proc, usage = run_standin(tmp_path, """
        import types, torch
        class TinyForCausalLM(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.config = types.SimpleNamespace(num_hidden_layers=2)
                self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
                self.head = torch.nn.Linear(8, 16)
            def forward(self, input_ids):
                x = torch.nn.functional.one_hot(input_ids, 8).float()
                for layer in self.layers:
                    x = layer(x)
                return self.head(x)
        model = TinyForCausalLM()
        def main_decode(input_ids):                  # the adapter's: the model called as a module
            return model(input_ids=input_ids)
        decode = torch.compile(main_decode, backend="npugraph_ex", fullgraph=True, dynamic=True)
        with torch.no_grad():
            for step in range(4):
                model(input_ids=torch.tensor([[1, 2, 3]]))      # an eager call: the probe's count moves on
                torch.testing.assert_close(decode(torch.tensor([[step % 8]])), model(torch.tensor([[step % 8]])))
    """, env={**probe, "NPU_STANDIN_COMPILE": "capture"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    entry = usage["compiles"]["main_decode [npugraph_ex]"]
    assert (entry["compiles"], entry["recompiles"]) == (1, 0), entry
    assert len(list(precision.record_dir(tmp_path).glob("rank_*/call_*.pt"))) >= 8      # the eager calls recorded
