"""What every kernel specialisation shares: its mangled name, its description in the manifest,
its compile flags, and (hand-written kernels) the Jinja environment of `ops/templates/`.

A spec names one compiled module: `spec.name` (`<kernel>.<variant>`) is the manifest key and the
vmfb's file name, and the variant spells out everything the module is specialised on (head counts,
dtypes, cache layout stride, decode query length, and for the GPU attend every tuning knob), so two
modules that differ in anything have different names.
"""
from __future__ import annotations

import dataclasses
import functools
import pathlib

import torch

from ..config import MsaConfig
from ..layout import HEAD_DIM, PAGE_SIZE, elements_per_16_bytes
from .fp8 import storage_dtype

TEMPLATES = pathlib.Path(__file__).resolve().parent / "templates"


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """A kernel specialised for one config; `name` is the manifest key and vmfb file name."""

    cfg: MsaConfig
    stride: int = 16  # block_page_stride the module is built for: 16 interleaved, 8 planes

    kernel = ""  # set by subclasses: the operation's name (the reference's function name)
    # the oldest CUDA compute capability (x10, e.g. 89) the module runs on, where it is newer than
    # the cuda target's sm_80; compile builds for it, the runtime refuses older GPUs by name
    cuda_arch = None

    def __post_init__(self):  # subclasses validate their specialisation here
        pass

    @functools.cached_property
    def name(self) -> str:  # cached: the runtime looks kernels up by it on every call
        return f"{self.kernel}.{self.variant}"

    @property
    def variant(self) -> str:
        c = self.cfg
        return f"h{c.num_heads}kv{c.num_kv_heads}.{c.kv_dtype}.q{c.query_dtype}.s{self.stride}"

    def describe(self) -> dict:
        return {"kernel": self.kernel, "variant": self.variant, "config": dataclasses.asdict(self.cfg),
                "block_page_stride": self.stride}

    def target_flags(self, target: str) -> list[str]:
        """Compiler flags this kernel adds after `target`'s own (a later --iree-cuda-target wins)."""
        return [f"--iree-cuda-target=sm_{self.cuda_arch}"] if target == "cuda" and self.cuda_arch else []


class ExportedSpec(KernelSpec):
    """A kernel whose formulation is a torch module traced by iree-turbine (ops/portable.py)."""

    def module(self) -> torch.nn.Module:
        raise NotImplementedError

    def example_args(self):
        raise NotImplementedError

    def dynamic_shapes(self):
        raise NotImplementedError

    # example tensors (sizes >= 2 so export keeps the dims symbolic)
    def _q(self, t=3):
        return torch.randn(t, self.cfg.num_heads, HEAD_DIM).to(self.cfg.query_torch_dtype)

    def _pages(self, p=40):
        kvd = storage_dtype(self.cfg.kv_torch_dtype)
        x = elements_per_16_bytes(self.cfg.kv_torch_dtype)
        h = self.cfg.num_kv_heads
        return (torch.zeros(p * h, HEAD_DIM // x, PAGE_SIZE, x, dtype=kvd),
                torch.zeros(p * h, PAGE_SIZE // x, HEAD_DIM, x, dtype=kvd))

    def _scales(self):
        return torch.ones(1), torch.ones(self.cfg.num_kv_heads, 2), torch.ones(self.cfg.num_kv_heads, 2)

    def _topk(self, t=3):
        return torch.zeros(self.cfg.num_kv_heads, t, self.cfg.topk, dtype=torch.int32)


class TemplateSpec(KernelSpec):
    """A kernel rendered from an `ops/templates/` MLIR template for the GPU targets in `targets`."""

    template = ""
    targets: tuple = ()
    # test_only: compiled for the tests (a twin that proves another kernel's numerics), never in a
    # deployment's kernel set and never what the runtime serves
    test_only = False

    def render(self) -> str:
        raise NotImplementedError

    def describe(self) -> dict:
        return {**super().describe(), "template": self.template, "targets": list(self.targets)}


@functools.cache
def _template_env():
    import jinja2

    # one environment: it keeps the parsed templates (and reloads one whose file changed)
    return jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), undefined=jinja2.StrictUndefined,
                              keep_trailing_newline=True)


def render_template(name: str, **params) -> str:
    """Render one Jinja MLIR template of ops/templates/ (undefined parameters are errors)."""
    if not (TEMPLATES / name).exists():
        raise FileNotFoundError(f"{TEMPLATES / name}: the MLIR templates are package data of msa_iree; "
                                "this installation is incomplete (reinstall msa-iree)")
    return _template_env().get_template(name).render(**params)


MLIR_ELEMENT = {"bf16": "bf16", "fp16": "f16", "fp8_e4m3fn": "i8", "fp8_e4m3fnuz": "i8"}
FP8_FORMAT = {"fp8_e4m3fn": "fn", "fp8_e4m3fnuz": "fnuz"}
