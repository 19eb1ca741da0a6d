"""Calls of every torch callable the stand-in patches (npu_standin.patches.PATCHED), each run eagerly and
compiled with `fullgraph=True` — by plain torch.compile and, under the stand-in, by its npugraph_ex
backend — then a model of plain nn.Linear / nn.Embedding / F.* layers the same way. Run by
test_capture.py twice: under the stand-in (DEVICE "npu") and without it (DEVICE "cpu": what torch itself
traces). Prints one JSON object: {"patched": [...], "examples": [{index, name, label, eager,
compile, npugraph_ex}], "models": {...}}; each outcome is {"ok": true, "value": a summary} or {"ok": false, "error": ...}.

argv: the plain torch.compile backend ("aot_eager": dynamo and AOT autograd without a C++ compiler;
"inductor": torch's default). Environment: CAPTURE_SWEEP_ONLY=i,j,... runs those examples only (no
models); CAPTURE_SWEEP_MODELS_ONLY=1 the models only; CAPTURE_SWEEP_FAULT=1 adds an untraceable patch.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

try:
    from npu_standin.activate import is_active
    STANDIN = is_active()
except ImportError:
    STANDIN = False
DEVICE = "npu" if STANDIN else "cpu"
DIST_BACKEND = "hccl" if STANDIN else "gloo"
BACKEND = sys.argv[1] if len(sys.argv) > 1 else "aot_eager"
WORK = tempfile.mkdtemp(prefix="capture-sweep-")
bf16, fp32 = torch.bfloat16, torch.float32


class Example:
    def __init__(self, name, label, fn, args=(), *, exact=True, before=None, after=None):
        self.name, self.label, self.fn, self.args = name, label, fn, args
        self.exact = exact          # False: random or uninitialised values (compare shape, dtype, device)
        self.before = before        # sets up what a call needs (a process group)
        self.after = after          # undoes what a call did to the process (a default device, a group)


EXAMPLES: list[Example] = []


def covers(name, *args, label=None, exact=True, before=None, after=None):
    def register(fn):
        EXAMPLES.append(Example(name, label or fn.__name__, fn, args, exact=exact, before=before, after=after))
        EXAMPLES[-1].index = len(EXAMPLES) - 1
        return fn

    return register


def t(*shape, dtype=fp32):
    gen = torch.Generator().manual_seed(sum(shape) + len(shape))
    return torch.randn(*shape, generator=gen).to(dtype)


# ---- matmul family (kernels/matmul.py): equal and mixed dtypes -----------------------------------
for _name, _fn in (("torch.matmul", lambda a, b: torch.matmul(a, b)), ("torch.Tensor.matmul", lambda a, b: a.matmul(b)),
                   ("torch.Tensor.__matmul__", lambda a, b: a @ b), ("torch.mm", lambda a, b: torch.mm(a, b)),
                   ("torch.Tensor.mm", lambda a, b: a.mm(b))):
    covers(_name, t(5, 8), t(8, 4), label="equal dtypes")(_fn)
    covers(_name, t(5, 8, dtype=bf16), t(8, 4), label="bf16 x fp32")(_fn)
for _name, _fn in (("torch.bmm", lambda a, b: torch.bmm(a, b)), ("torch.Tensor.bmm", lambda a, b: a.bmm(b))):
    covers(_name, t(2, 5, 8), t(2, 8, 4), label="equal dtypes")(_fn)
    covers(_name, t(2, 5, 8, dtype=bf16), t(2, 8, 4), label="bf16 x fp32")(_fn)
for _name, _fn in (("torch.addmm", lambda c, a, b: torch.addmm(c, a, b, beta=0.5)),
                   ("torch.Tensor.addmm", lambda c, a, b: c.addmm(a, b, alpha=2.0))):
    covers(_name, t(4), t(5, 8), t(8, 4), label="equal dtypes")(_fn)
    covers(_name, t(4), t(5, 8, dtype=bf16), t(8, 4), label="fp32 bias, bf16 x fp32")(_fn)
_linear = lambda x, w, b=None: F.linear(x, w, b)  # noqa: E731
covers("torch.nn.functional.linear", t(5, 8), t(4, 8), t(4), label="equal dtypes, bias")(_linear)
covers("torch.nn.functional.linear", t(2, 5, 8), t(4, 8), label="3-D, no bias")(_linear)
covers("torch.nn.functional.linear", t(5, 8, dtype=bf16), t(4, 8), t(4), label="bf16 x fp32 + fp32 bias")(_linear)
covers("torch.nn.functional.linear", t(2, 5, 8, dtype=bf16).transpose(0, 1), t(4, 8), label="strided bf16 x fp32")(
    _linear)
covers("torch.nn.functional.linear", t(5, 8), label="nn.Linear")(lambda x, _m=nn.Linear(8, 4): _m(x))
# A replaced Tensor method called unbound (torch.Tensor.matmul(a, b)): dynamo inlines the replacement and
# meets the real method descriptor inside it.
for _name in ("matmul", "mm"):
    covers(f"torch.Tensor.{_name}", t(5, 8, dtype=bf16), t(8, 4), label="unbound, bf16 x fp32")(
        lambda a, b, _name=_name: getattr(torch.Tensor, _name)(a, b))
covers("torch.Tensor.bmm", t(2, 5, 8), t(2, 8, 4), label="unbound")(lambda a, b: torch.Tensor.bmm(a, b))
covers("torch.Tensor.addmm", t(4), t(5, 8), t(8, 4), label="unbound")(lambda c, a, b: torch.Tensor.addmm(c, a, b))

# ---- device (device.py): torch.device, factories, Tensor / Module methods, autocast ---------------
covers("torch.device", t(3))(lambda x: x.to(torch.device(DEVICE)) + 1)
covers("torch.device", t(3), label="device(type, index)")(lambda x: x.to(torch.device(DEVICE, 0)) * 2)
_FACTORY_CALLS = {
    "logspace": lambda: torch.logspace(0, 1, 4, device=DEVICE),
    "randint": lambda: torch.randint(0, 5, (3,), device=DEVICE),
    "hann_window": lambda: torch.hann_window(4, device=DEVICE),
    "rand": lambda: torch.rand(3, device=DEVICE),
    "full_like": lambda: torch.full_like(torch.ones(2), 3.0, device=DEVICE),
    "ones_like": lambda: torch.ones_like(torch.zeros(2), device=DEVICE),
    "rand_like": lambda: torch.rand_like(torch.zeros(2), device=DEVICE),
    "randperm": lambda: torch.randperm(4, device=DEVICE),
    "arange": lambda: torch.arange(4, device=DEVICE),
    "frombuffer": lambda: torch.frombuffer(bytearray(b"abcd"), dtype=torch.uint8),
    "normal": lambda: torch.normal(0.0, 1.0, size=(3,), device=DEVICE),
    "empty_strided": lambda: torch.empty_strided((2, 3), (3, 1), device=DEVICE),
    "empty_like": lambda: torch.empty_like(torch.zeros(2), device=DEVICE),
    "scalar_tensor": lambda: torch.scalar_tensor(1.5, device=DEVICE),
    "tril_indices": lambda: torch.tril_indices(3, 3, device=DEVICE),
    "bartlett_window": lambda: torch.bartlett_window(4, device=DEVICE),
    "ones": lambda: torch.ones(2, 3, device=DEVICE),
    "sparse_coo_tensor": lambda: torch.sparse_coo_tensor(torch.tensor([[0, 1]]), torch.tensor([1.0, 2.0]), (3,),
                                                         device=DEVICE).to_dense(),
    "randn": lambda: torch.randn(3, device=DEVICE),
    "randn_like": lambda: torch.randn_like(torch.zeros(2), device=DEVICE),
    "kaiser_window": lambda: torch.kaiser_window(4, device=DEVICE),
    "tensor": lambda: torch.tensor([1.0, 2.0], device=DEVICE),
    "triu_indices": lambda: torch.triu_indices(3, 3, device=DEVICE),
    "as_tensor": lambda: torch.as_tensor([1.0, 2.0], device=DEVICE),
    "zeros": lambda: torch.zeros(2, 3, device=DEVICE),
    "randint_like": lambda: torch.randint_like(torch.zeros(3), 5, device=DEVICE),
    "full": lambda: torch.full((2,), 3.0, device=DEVICE),
    "eye": lambda: torch.eye(3, device=DEVICE),
    "empty": lambda: torch.empty(2, 3, device=DEVICE),
    "blackman_window": lambda: torch.blackman_window(4, device=DEVICE),
    "zeros_like": lambda: torch.zeros_like(torch.ones(2), device=DEVICE),
    "range": lambda: torch.range(0, 3, device=DEVICE),
    "sparse_csr_tensor": lambda: torch.sparse_csr_tensor(torch.tensor([0, 1, 2]), torch.tensor([0, 1]),
                                                         torch.tensor([1.0, 2.0]), (2, 2), device=DEVICE).to_dense(),
    "from_file": lambda: torch.from_file(os.path.join(WORK, "bytes.bin"), size=4, dtype=torch.uint8, device=DEVICE),
    "linspace": lambda: torch.linspace(0, 1, 5, device=DEVICE),
    "hamming_window": lambda: torch.hamming_window(4, device=DEVICE),
    "empty_quantized": lambda: torch.empty_quantized([2], torch.quantize_per_tensor(torch.ones(2), 0.1, 0,
                                                                                      torch.quint8)).shape[0],
    "sparse_compressed_tensor": lambda: torch.sparse_compressed_tensor(
        torch.tensor([0, 1, 2]), torch.tensor([0, 1]), torch.tensor([1.0, 2.0]), (2, 2), layout=torch.sparse_csr,
        device=DEVICE).to_dense(),
    "asarray": lambda: torch.asarray([1.0, 2.0], device=DEVICE),
    "empty_permuted": lambda: torch.empty_permuted((2, 3), (1, 0), device=DEVICE),
}
_RANDOM = {"randint", "rand", "rand_like", "randperm", "normal", "empty_strided", "empty_like", "randn", "randn_like",
           "randint_like", "empty", "empty_permuted"}
for _factory, _call in _FACTORY_CALLS.items():
    covers(f"torch.{_factory}", exact=_factory not in _RANDOM, label="device=npu")(_call)
covers("torch.load")(lambda: torch.load(os.path.join(WORK, "saved.pt"), map_location=DEVICE) + 1)
covers("torch.Tensor.to", t(3))(lambda x: x.to(DEVICE) + 1)
covers("torch.Tensor.to", t(3), label="to(device, dtype)")(lambda x: x.to(DEVICE, torch.bfloat16))
covers("torch.Tensor.to", t(3), label="to(device=, non_blocking=)")(lambda x: x.to(device=DEVICE, non_blocking=True))
covers("torch.Tensor.to", t(3), label="unbound")(lambda x: torch.Tensor.to(x, DEVICE) + 1)
for _method in ("new_empty", "new_zeros", "new_ones"):
    covers(f"torch.Tensor.{_method}", t(3), exact=_method != "new_empty")(
        lambda x, _method=_method: getattr(x, _method)((2,), device=DEVICE))
covers("torch.Tensor.new_empty_strided", t(3), exact=False)(lambda x: x.new_empty_strided((2, 2), (2, 1), device=DEVICE))
covers("torch.Tensor.new_zeros", t(3), label="unbound")(lambda x: torch.Tensor.new_zeros(x, (2,), device=DEVICE))
covers("torch.Tensor.new_full", t(3))(lambda x: x.new_full((2,), 7.0, device=DEVICE))
covers("torch.Tensor.new_tensor", t(3))(lambda x: x.new_tensor([1.0, 2.0], device=DEVICE) + x[:2])
covers("torch.Tensor.pin_memory", t(3))(lambda x: x.pin_memory() + 1)
covers("torch.Tensor.npu", t(3))(lambda x: x.npu() * 2)
covers("torch.Tensor.is_npu", t(3))(lambda x: x + 1 if x.is_npu else x - 1)
covers("torch.Tensor.record_stream", t(3))(lambda x: (x.record_stream(torch.npu.current_stream()), x * 2)[1])
_module = nn.Linear(3, 2)
covers("torch.nn.Module.to", t(3))(lambda x: _module.to(DEVICE)(x))
covers("torch.nn.Module.to_empty", t(3), exact=False)(lambda x: nn.Linear(3, 2).to_empty(device=DEVICE)(x))
covers("torch.nn.Module.npu", t(3))(lambda x: _module.npu()(x))
covers("torch.Generator", exact=False)(lambda: torch.rand(2, generator=torch.Generator(device=DEVICE)))
covers("torch.amp.autocast_mode.autocast.__init__", t(5, 8), t(8, 4))(
    lambda a, b: _autocast_matmul(a, b))
covers("torch.is_autocast_enabled", t(3))(lambda x: x + 1 if torch.is_autocast_enabled(DEVICE) else x - 1)
covers("torch.get_autocast_dtype", t(3))(lambda x: x.to(torch.get_autocast_dtype(DEVICE)))
_AUTOCAST = {"enabled": torch.is_autocast_enabled("cpu"), "dtype": torch.get_autocast_dtype("cpu")}


def _restore_autocast():
    torch.set_autocast_enabled("cpu", _AUTOCAST["enabled"])
    torch.set_autocast_dtype("cpu", _AUTOCAST["dtype"])


covers("torch.set_autocast_enabled", t(3), after=_restore_autocast)(
    lambda x: (torch.set_autocast_enabled(DEVICE, False), x + 1)[1])
covers("torch.set_autocast_dtype", t(3), after=_restore_autocast)(
    lambda x: (torch.set_autocast_dtype(DEVICE, torch.bfloat16), x + 1)[1])
covers("torch.get_device_module", t(3))(lambda x: x + 1 if torch.get_device_module(DEVICE).is_available() else x)
covers("torch.set_default_device", t(3), after=lambda: torch.set_default_device(None))(
    lambda x: (torch.set_default_device(DEVICE), x + 1)[1])


def _autocast_matmul(a, b):
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        return (a @ b).float()


# ---- torch.npu (npu_module.py), torch.compile, the op namespaces, torch.distributed --------------
covers("torch.npu", t(3), label="current_device / is_available")(
    lambda x: x + torch.npu.current_device() if torch.npu.is_available() else x)
covers("torch.npu", t(3), label="current_stream")(lambda x: (torch.npu.current_stream(), x + 1)[1])
covers("torch.npu", t(3), label="stream context")(lambda x: _on_current_stream(x))
covers("torch.compile", t(3))(lambda x: torch.compile(lambda y: y * 3)(x))
covers("torch.ops.npu", t(2, 8), t(8))(lambda x, g: torch.ops.npu.npu_rms_norm(x, g, 1e-6)[0])
covers("torch.ops.air", t(5, 4, 8), t(5, 2, 8), t(5, 2, 8))(
    lambda q, k, v: torch.ops.air.npu_fused_infer_attention_score_v2(
        q, k, v, num_query_heads=4, num_key_value_heads=2, softmax_scale=0.3, input_layout="TND", sparse_mode=0,
        actual_seq_qlen=torch.tensor([2, 5]), actual_seq_kvlen=torch.tensor([2, 5]))[0])


def _on_current_stream(x):
    stream = torch.npu.current_stream()
    with torch.npu.stream(stream):
        y = x + 1
    torch.npu.current_stream().wait_stream(stream)
    return y


def _destroy_group():
    if dist.is_initialized():
        dist.destroy_process_group()


def _init_group():
    dist.init_process_group(DIST_BACKEND, init_method=f"file://{WORK}/group-{len(os.listdir(WORK))}",
                            world_size=1, rank=0)


covers("torch.distributed.init_process_group", after=_destroy_group)(lambda: (_init_group(), dist.get_world_size())[1])
covers("torch.distributed.distributed_c10d.init_process_group", after=_destroy_group)(
    lambda: (dist.distributed_c10d.init_process_group(
        DIST_BACKEND, init_method=f"file://{WORK}/group-c10d-{len(os.listdir(WORK))}", world_size=1, rank=0),
        dist.get_rank())[1])
covers("torch.distributed.new_group", t(3), before=_init_group, after=_destroy_group)(
    lambda x: (dist.new_group([0], backend=DIST_BACKEND), x + 1)[1])
covers("torch.distributed.distributed_c10d.new_group", t(3), before=_init_group, after=_destroy_group)(
    lambda x: (dist.distributed_c10d.new_group([0], backend=DIST_BACKEND), x + 1)[1])
covers("torch.distributed.is_hccl_available", t(3))(lambda x: x + 1 if dist.is_hccl_available() else x - 1)


# ---- a model of plain layers ---------------------------------------------------------------------
class PlainLayers(nn.Module):
    """What an adapter recipe's decode meets: Embedding, Linear with and without bias, LayerNorm,
    F.gelu / F.silu / F.softmax / F.scaled_dot_product_attention / F.embedding, a tied lm head (F.linear)."""

    def __init__(self, vocab=64, hidden=32, heads=4):
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden, bias=False)
        self.up = nn.Linear(hidden, 2 * hidden)
        self.down = nn.Linear(2 * hidden, hidden)
        self.gate = nn.Linear(hidden, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.positions = nn.Parameter(torch.randn(16, hidden) * 0.02)

    def forward(self, ids):
        h = self.embed(ids) + F.embedding(torch.arange(ids.shape[1], device=ids.device), self.positions)
        b, s, d = h.shape
        q, k, v = self.qkv(self.norm(h)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        h = h + self.out(attn)
        h = h + self.down(F.gelu(self.up(h)) * F.silu(self.up(h)))
        h = h * torch.sigmoid(self.gate(h)).to(h.dtype)
        return F.softmax(F.linear(self.norm(h), self.embed.weight).float(), dim=-1)


class MixedDtypeLayers(PlainLayers):
    """The same in bf16 with an fp32 gate (a router kept in fp32, as qwen3_moe's): F.linear of bf16 x fp32."""

    def __init__(self):
        super().__init__()
        self.to(bf16)
        self.gate.float()


def summary(value):
    if isinstance(value, torch.Tensor):
        return {"shape": list(value.shape), "dtype": str(value.dtype), "device": value.device.type}
    if isinstance(value, (list, tuple)):
        return [summary(v) for v in value]
    return repr(value)


def same(a, b, exact: bool) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if (a.shape, a.dtype, a.device) != (b.shape, b.dtype, b.device):
            return False
        return not exact or torch.allclose(a.double(), b.double(), atol=1e-5, rtol=1e-4)
    return a == b


def run(fn, args, after, before=None):
    try:
        if before is not None:
            before()
        return True, fn(*args)
    except Exception as exc:  # noqa: BLE001 - the outcome is what the test reads
        return False, f"{type(exc).__module__}.{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
    finally:
        if after is not None:
            after()


def outcome(ok, value, eager=None, exact=True):
    if not ok:
        return {"ok": False, "error": value}
    result = {"ok": True, "value": summary(value)}
    if eager is not None and eager[0]:
        result["same_as_eager"] = bool(same(value, eager[1], exact))
    return result


def sweep() -> list[dict]:
    torch.save(torch.arange(3.0), os.path.join(WORK, "saved.pt"))
    with open(os.path.join(WORK, "bytes.bin"), "wb") as handle:
        handle.write(b"\x01\x02\x03\x04")
    rows = []
    for example in EXAMPLES:
        row = {"index": example.index, "name": example.name, "label": example.label}
        eager = run(example.fn, example.args, example.after, example.before)
        row["eager"] = outcome(*eager)
        backends = [("compile", BACKEND)] + ([("npugraph_ex", "npugraph_ex")] if STANDIN else [])
        for key, backend in backends:
            torch._dynamo.reset()
            compiled = torch.compile(example.fn, fullgraph=True, backend=backend)
            row[key] = outcome(*run(compiled, example.args, example.after, example.before), eager=eager,
                               exact=example.exact)
        rows.append(row)
    return rows


def models() -> dict:
    result = {}
    for net in (PlainLayers(), MixedDtypeLayers()):
        torch.manual_seed(0)
        net = net.to(DEVICE).eval()
        ids = torch.randint(0, 64, (2, 7), device=DEVICE)
        rows = result[type(net).__name__] = {}
        with torch.no_grad():
            want = net(ids)
            backends = [("compile", BACKEND)] + ([("npugraph_ex", "npugraph_ex")] if STANDIN else [])
            for key, backend in backends:
                torch._dynamo.reset()
                compiled = torch.compile(net, fullgraph=True, dynamic=True, backend=backend)
                outs = [run(compiled, (ids,), None) for _ in range(2)]
                outs.append(run(compiled, (torch.randint(0, 64, (2, 9), device=DEVICE),), None))   # another length
                rows[key] = outcome(*outs[0], eager=(True, want))
                rows[key]["all_ran"] = all(ok for ok, _ in outs)
                if not rows[key]["all_ran"]:
                    rows[key]["error"] = next(value for ok, value in outs if not ok)
    return result


def inject_fault() -> None:
    """CAPTURE_SWEEP_FAULT=1: one more patched callable, written as the mixed-dtype F.linear patch
    first was (its real looked up in a dict keyed by a module object): the test must name it."""
    from npu_standin.patches import replace

    reals = {}

    def untraceable(real):
        reals[(F, "gelu")] = real

        def gelu(input, approximate="none"):
            return reals.get((F, "gelu"), real)(input, approximate=approximate)

        return gelu

    replace(F, "gelu", untraceable)


if __name__ == "__main__":
    from npu_standin.patches import PATCHED

    if os.environ.get("CAPTURE_SWEEP_FAULT") and STANDIN:
        inject_fault()
    report = {"standin": STANDIN, "patched": sorted(PATCHED), "covered": sorted({e.name for e in EXAMPLES})}
    only = os.environ.get("CAPTURE_SWEEP_ONLY")        # indices of EXAMPLES (the plain run: what torch traces)
    if only is not None:
        EXAMPLES[:] = [EXAMPLES[int(i)] for i in only.split(",") if i]
    if os.environ.get("CAPTURE_SWEEP_MODELS_ONLY"):
        EXAMPLES.clear()
    report["examples"] = sweep()
    if only is None:
        report["models"] = models()
    print("CAPTURE-SWEEP " + json.dumps(report))
