"""Shape grids: one benchmark/tuning case (``ShapeSpec``) and named presets of them."""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, replace

import torch

from tsdecode.configs import ProblemShape

DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float32": torch.float32,
}


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"unsupported dtype {dtype}")


@dataclass(frozen=True)
class ShapeSpec:
    """One decode problem: every request has kv_len K/V tokens (ragged: lengths drawn in
    [kv_len // 2, kv_len] with the longest exactly kv_len) and seq_len_q query tokens (packed:
    lengths drawn in [1, seq_len_q])."""

    batch_size: int
    kv_len: int
    num_qo_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 16
    q_dtype: str = "bfloat16"
    kv_dtype: str = "bfloat16"
    o_dtype: str = "bfloat16"
    seq_len_q: int = 1
    packed: bool = False
    mask_type: str = "dense"
    window_left: int = -1
    ragged: bool = False

    def __post_init__(self) -> None:
        for name in ("q_dtype", "kv_dtype", "o_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"{name} must be one of {list(DTYPES)}, got {getattr(self, name)!r}")
        for name in ("batch_size", "kv_len", "num_qo_heads", "num_kv_heads", "head_dim", "page_size", "seq_len_q"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_qo_heads % self.num_kv_heads:
            raise ValueError(
                f"num_qo_heads ({self.num_qo_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.mask_type not in ("dense", "causal"):
            raise ValueError(f"mask_type must be 'dense' or 'causal', got {self.mask_type!r}")
        if self.window_left >= 0 and self.mask_type != "causal":
            raise ValueError("window_left >= 0 needs mask_type='causal'")

    @property
    def name(self) -> str:
        parts = [f"B{self.batch_size}", f"L{self.kv_len}", f"H{self.num_qo_heads}x{self.num_kv_heads}",
                 f"D{self.head_dim}", f"P{self.page_size}", self.kv_dtype]
        if self.seq_len_q > 1 or self.packed:
            parts.append(f"{'packed' if self.packed else 'SQ'}{self.seq_len_q}")
        if self.mask_type != "dense":
            parts.append(self.mask_type + (f"-w{self.window_left}" if self.window_left >= 0 else ""))
        if self.ragged:
            parts.append("ragged")
        return "_".join(parts)

    @property
    def mask_kind(self) -> str:
        return "windowed" if self.window_left >= 0 else self.mask_type

    def to_problem_shape(self) -> ProblemShape:
        return ProblemShape(
            batch_size=self.batch_size, num_qo_heads=self.num_qo_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, page_size=self.page_size,
            max_kv_len=self.kv_len, max_seq_len_q=self.seq_len_q, packed=self.packed,
            mask_kind=self.mask_kind, q_dtype=DTYPES[self.q_dtype], kv_dtype=DTYPES[self.kv_dtype],
            o_dtype=DTYPES[self.o_dtype], window_left=self.window_left,
        )

    def to_dict(self) -> dict:
        return asdict(self)


def grid(batch_sizes, kv_lens, **fixed) -> list[ShapeSpec]:
    """The cross product of batch sizes and K/V lengths with the other fields fixed."""
    return [ShapeSpec(batch_size=b, kv_len=l, **fixed) for b, l in itertools.product(batch_sizes, kv_lens)]


def _llama(hq: int, hkv: int) -> list[ShapeSpec]:
    # The issue's and the anchors' decode shapes; K/V working sets up to 16 GiB.
    return grid((1, 8, 32, 128), (1024, 8192, 32768), num_qo_heads=hq, num_kv_heads=hkv) + [
        ShapeSpec(1, 131072, num_qo_heads=hq, num_kv_heads=hkv),
        ShapeSpec(256, 4096, num_qo_heads=hq, num_kv_heads=hkv),
    ]


PRESETS: dict[str, list[ShapeSpec]] = {
    # Tiny shapes that run in seconds, also in the interpreter.
    "smoke": grid((1, 3), (40, 130), num_qo_heads=4, num_kv_heads=2, head_dim=64),
    "llama3-8b": _llama(32, 8),
    "llama3-70b-tp1": _llama(64, 8),
    "llama3-70b-tp2": _llama(32, 4),
    "llama3-70b-tp4": _llama(16, 2),
    "llama3-70b-tp8": _llama(8, 1),
    "qwen2.5-7b": grid((1, 8, 32, 128), (1024, 8192, 32768), num_qo_heads=28, num_kv_heads=4),
    "mistral-7b": grid((1, 8, 32, 128), (1024, 8192, 32768), num_qo_heads=32, num_kv_heads=8,
                       mask_type="causal", window_left=4095),
    "mha": grid((1, 8, 32, 128), (1024, 8192), num_qo_heads=32, num_kv_heads=32),
    "g16": grid((1, 8, 32, 128), (1024, 8192, 32768), num_qo_heads=64, num_kv_heads=4),
    "g32": grid((1, 8, 32, 128), (1024, 8192, 32768), num_qo_heads=64, num_kv_heads=2),
    "fp8": [replace(s, kv_dtype="float8_e4m3fn") for s in _llama(32, 8)],
}


def preset(name: str) -> list[ShapeSpec]:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return list(PRESETS[name])


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"expected a comma-separated list of integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"expected positive integers, got {text!r}")
    return values


def _heads_list(text: str) -> list[tuple[int, int]]:
    """'32:8,64:8' -> [(32, 8), (64, 8)] (query heads : KV heads)."""
    pairs = []
    for item in text.split(","):
        try:
            hq, hkv = (int(x) for x in item.split(":"))
        except ValueError:
            raise ValueError(f"--heads expects HQ:HKV pairs like 32:8, got {item!r}") from None
        pairs.append((hq, hkv))
    return pairs


def add_grid_arguments(parser) -> None:
    """Shape-grid flags shared by tuning and reports (argparse)."""
    g = parser.add_argument_group("shape grid")
    g.add_argument("--preset", action="append", default=None,
                   help=f"named grid; repeatable. One of: {', '.join(sorted(PRESETS))}")
    g.add_argument("--grid-file", default=None,
                   help="TOML file: [[grid]] tables with the same keys as the flags below "
                        "(batch_sizes, kv_lens, heads, head_dim, page_sizes, kv_dtypes, ...)")
    g.add_argument("--batch-sizes", help="custom grid: comma-separated batch sizes, e.g. 1,8,64")
    g.add_argument("--kv-lens", help="custom grid: comma-separated K/V lengths, e.g. 1024,8192")
    g.add_argument("--heads", default="32:8", help="custom grid: HQ:HKV pairs, e.g. 32:8,64:8")
    g.add_argument("--head-dim", default="128", help="custom grid: head dims, e.g. 64,128")
    g.add_argument("--page-sizes", default="16", help="custom grid: page sizes, e.g. 1,16,64")
    g.add_argument("--kv-dtypes", default="bfloat16", help="custom grid: K/V dtypes (q/out follow "
                   "unless --q-dtype is given; an fp8 cache takes bf16 q)")
    g.add_argument("--q-dtype", default=None, help="custom grid: query dtype")
    g.add_argument("--seq-len-q", type=int, default=1, help="custom grid: query tokens per request")
    g.add_argument("--packed", action="store_true", help="custom grid: packed queries (qo_indptr)")
    g.add_argument("--mask", default="dense", choices=("dense", "causal"))
    g.add_argument("--window-left", type=int, default=-1)
    g.add_argument("--ragged", action="store_true", help="custom grid: ragged K/V lengths")


def _custom_grid(opts: dict) -> list[ShapeSpec]:
    def get(key, default=None):
        return opts.get(key, default)

    batch_sizes = get("batch_sizes")
    kv_lens = get("kv_lens")
    if batch_sizes is None or kv_lens is None:
        raise ValueError("a custom grid needs both batch sizes and K/V lengths")
    as_ints = lambda v: _int_list(v) if isinstance(v, str) else [int(x) for x in v]
    heads = get("heads", "32:8")
    heads = _heads_list(heads) if isinstance(heads, str) else [tuple(h) for h in heads]
    kv_dtypes = get("kv_dtypes", "bfloat16")
    kv_dtypes = kv_dtypes.split(",") if isinstance(kv_dtypes, str) else list(kv_dtypes)
    specs = []
    for (hq, hkv), d, p, kv_dtype in itertools.product(
        heads, as_ints(get("head_dim", "128")), as_ints(get("page_sizes", "16")), kv_dtypes
    ):
        q_dtype = get("q_dtype") or ("bfloat16" if kv_dtype == "float8_e4m3fn" else kv_dtype)
        o_dtype = "bfloat16" if q_dtype == "float8_e4m3fn" else q_dtype
        specs += grid(
            as_ints(batch_sizes), as_ints(kv_lens), num_qo_heads=hq, num_kv_heads=hkv,
            head_dim=d, page_size=p, q_dtype=q_dtype, kv_dtype=kv_dtype, o_dtype=o_dtype,
            seq_len_q=int(get("seq_len_q", 1)), packed=bool(get("packed", False)),
            mask_type=get("mask", "dense"), window_left=int(get("window_left", -1)),
            ragged=bool(get("ragged", False)),
        )
    return specs


def specs_from_args(args) -> list[ShapeSpec]:
    """The grid an argparse namespace from ``add_grid_arguments`` names (presets + file + flags),
    without duplicates, in order. Raises ValueError for a bad or empty grid."""
    specs: list[ShapeSpec] = []
    for name in args.preset or []:
        specs += preset(name)
    if args.grid_file:
        import tomllib

        with open(args.grid_file, "rb") as f:
            data = tomllib.load(f)
        tables = data.get("grid")
        if not isinstance(tables, list) or not tables:
            raise ValueError(f"{args.grid_file}: expected one or more [[grid]] tables")
        for table in tables:
            specs += _custom_grid(table)
    if args.batch_sizes or args.kv_lens:
        specs += _custom_grid({
            "batch_sizes": args.batch_sizes, "kv_lens": args.kv_lens, "heads": args.heads,
            "head_dim": args.head_dim, "page_sizes": args.page_sizes, "kv_dtypes": args.kv_dtypes,
            "q_dtype": args.q_dtype, "seq_len_q": args.seq_len_q, "packed": args.packed,
            "mask": args.mask, "window_left": args.window_left, "ragged": args.ragged,
        })
    if not specs:
        raise ValueError("empty shape grid: give --preset, --grid-file or --batch-sizes with --kv-lens")
    return list(dict.fromkeys(specs))
