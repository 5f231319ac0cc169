"""Shape grids: one benchmark/tuning case (``ShapeSpec``) and named presets of them."""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, replace
from typing import Sequence

import torch

from tsdecode.config.space import ProblemShape
from tsdecode.config.tables import dtype_name

from .arguments import int_list

# The dtypes a grid may name, by the names tables and reports use (``tables.dtype_name``).
DTYPES = {dtype_name(d): d for d in (torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float32)}
# The names a query or a K/V cache may have (float32 is an output dtype only).
INPUT_DTYPE_NAMES = ("float16", "bfloat16", "float8_e4m3fn")


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
        if self.mask_type == "causal" and self.seq_len_q > self.kv_len:
            raise ValueError(f"a causal mask needs seq_len_q <= kv_len, got seq_len_q={self.seq_len_q} and "
                             f"kv_len={self.kv_len}")

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

    def to_problem_shape(self, seq_lens: Sequence[int] | None = None) -> ProblemShape:
        """The runtime's view of this case; ``seq_lens`` (the drawn lengths) sets the length spread
        a plan owning them sees."""
        spread = 1.0 if not seq_lens else max(seq_lens) * len(seq_lens) / sum(seq_lens)
        return ProblemShape(
            batch_size=self.batch_size, num_qo_heads=self.num_qo_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, page_size=self.page_size,
            max_kv_len=self.kv_len, max_seq_len_q=self.seq_len_q, packed=self.packed,
            mask_kind=self.mask_kind, q_dtype=DTYPES[self.q_dtype], kv_dtype=DTYPES[self.kv_dtype],
            o_dtype=DTYPES[self.o_dtype], kv_len_spread=spread, window_left=self.window_left,
        )

    def to_dict(self) -> dict:
        return asdict(self)


def grid(batch_sizes, kv_lens, **fixed) -> list[ShapeSpec]:
    """The cross product of batch sizes and K/V lengths with the other fields fixed."""
    return [ShapeSpec(batch_size=b, kv_len=l, **fixed) for b, l in itertools.product(batch_sizes, kv_lens)]


def _llama(hq: int, hkv: int) -> list[ShapeSpec]:
    # Llama-3 decode shapes of serving engines; K/V working sets up to 16 GiB.
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
    "llama3.2-1b": grid((1, 8, 32, 128), (1024, 8192, 32768), num_qo_heads=32, num_kv_heads=8,
                        head_dim=64),
    "llama3.2-3b": grid((1, 8, 32, 128), (1024, 8192, 32768), num_qo_heads=24, num_kv_heads=8),
    "mha": grid((1, 8, 32, 128), (1024, 8192), num_qo_heads=32, num_kv_heads=32),
    "g16": grid((1, 8, 32, 128), (1024, 8192, 32768), num_qo_heads=64, num_kv_heads=4),
    "g32": grid((1, 8, 32, 128), (1024, 8192, 32768), num_qo_heads=64, num_kv_heads=2),
    "fp8": [replace(s, kv_dtype="float8_e4m3fn") for s in _llama(32, 8)],
}


def preset(name: str) -> list[ShapeSpec]:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return list(PRESETS[name])


def _heads_list(text: str) -> list[tuple[int, int]]:
    """'32:8,64:8' -> [(32, 8), (64, 8)] (query heads : KV heads)."""
    pairs = []
    for item in text.split(","):
        try:
            hq, hkv = (int(x) for x in item.split(":"))
        except ValueError:
            raise ValueError(f"expected HQ:HKV pairs like 32:8, got {item!r}") from None
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
    # The other custom-grid flags default to None, so that one given without a custom grid is
    # refused instead of ignored; _custom_grid supplies their defaults.
    g.add_argument("--heads", default=None, help="custom grid: HQ:HKV pairs, e.g. 32:8,64:8 (default 32:8)")
    g.add_argument("--head-dim", default=None, help="custom grid: head dims, e.g. 64,128 (default 128)")
    g.add_argument("--page-sizes", default=None, help="custom grid: page sizes, e.g. 1,16,64 (default 16)")
    g.add_argument("--kv-dtypes", default=None, help="custom grid: K/V dtypes, of "
                   f"{', '.join(INPUT_DTYPE_NAMES)} (q/out follow unless --q-dtype is given; an fp8 cache takes "
                   "bf16 q)")
    g.add_argument("--q-dtype", default=None, help=f"custom grid: query dtype, one of {', '.join(INPUT_DTYPE_NAMES)} "
                   "(default: the K/V dtype, bfloat16 for an fp8 cache)")
    g.add_argument("--seq-len-q", type=int, default=None, help="custom grid: query tokens per request (default 1)")
    g.add_argument("--packed", action="store_true", help="custom grid: packed queries (qo_indptr)")
    g.add_argument("--mask", default=None, choices=("dense", "causal"),
                   help="custom grid: dense: every query token sees all K/V tokens; causal: only those up to its "
                        "own position (default dense)")
    g.add_argument("--window-left", type=int, default=None,
                   help="custom grid: sliding window, with --mask causal: each query token sees itself and at "
                        "most this many K/V tokens before it (default -1: no window)")
    g.add_argument("--ragged", action="store_true", help="custom grid: ragged K/V lengths")


# The keys of a custom grid: the flags without "--" (and "-" as "_"), and of a [[grid]] table.
GRID_KEYS = ("batch_sizes", "kv_lens", "heads", "head_dim", "page_sizes", "kv_dtypes", "q_dtype",
             "seq_len_q", "packed", "mask", "window_left", "ragged")


def _ints(value, what: str, single: bool = False) -> list[int]:
    """Positive ints from "1,8,64" or a TOML array [1, 8, 64] (or one int if ``single``)."""
    if isinstance(value, str):
        try:
            return int_list(value)
        except ValueError as e:
            raise ValueError(f"{what}: {e}") from None
    if single and type(value) is int:
        value = [value]
    if not (isinstance(value, list) and value and all(type(v) is int for v in value)):
        raise ValueError(f"{what}: expected a list of integers like [1, 8] or \"1,8\", got "
                         f"{value!r}")
    if min(value) < 1:
        raise ValueError(f"{what}: expected positive integers, got {value!r}")
    return value


def _heads(value, what: str) -> list[tuple[int, int]]:
    """(HQ, HKV) pairs from "32:8,64:8" or a TOML array [[32, 8], [64, 8]] (or ["32:8"])."""
    items = [value] if isinstance(value, str) else value
    pairs = []
    if isinstance(items, list) and items:
        for item in items:
            if isinstance(item, str):
                try:
                    pairs += _heads_list(item)
                except ValueError as e:
                    raise ValueError(f"{what}: {e}") from None
            elif isinstance(item, list) and len(item) == 2 and all(type(x) is int for x in item):
                pairs.append((item[0], item[1]))
            else:
                break
        else:
            return pairs
    raise ValueError(f"{what}: expected HQ:HKV pairs like \"32:8,64:8\" or [[32, 8], [64, 8]], "
                     f"got {value!r}")


def _dtype_names(value, what: str, single: bool = False) -> list[str]:
    """dtype names from "bfloat16,float16" or a TOML array (one name if ``single``)."""
    names = value.split(",") if isinstance(value, str) and not single else value
    names = [names] if single else names
    if not (isinstance(names, list) and names and all(isinstance(n, str) for n in names)):
        raise ValueError(f"{what}: expected {'a dtype name' if single else 'dtype names'}, got "
                         f"{value!r}")
    bad = [n for n in names if n.strip() not in DTYPES]
    if bad:
        raise ValueError(f"{what}: unknown dtype(s) {bad}; one of {list(DTYPES)}")
    return [n.strip() for n in names]


def _scalar(value, what: str, kind: type, minimum: int | None = None):
    """An int (at least ``minimum``) or a bool, strictly: TOML's "no" or 1.5 are errors."""
    ok = type(value) is kind and (minimum is None or value >= minimum)
    if not ok:
        noun = "true or false" if kind is bool else f"an integer >= {minimum}"
        raise ValueError(f"{what}: expected {noun}, got {value!r}")
    return value


def _custom_grid(opts: dict, where: str = "") -> list[ShapeSpec]:
    """The shapes of one custom grid (GRID_KEYS; batch_sizes and kv_lens required).

    ``where`` is "" for the command line (keys are named as flags) or the location of a
    [[grid]] table ("--grid-file grid.toml: [[grid]] 2: "; keys are named as in the file), which
    starts every message. Raises ValueError naming the key for an unknown key, a wrong type or an
    unsupported value (head_dim, page size and group size as ``tsdecode.validation`` checks them).
    """
    try:
        return _grid_shapes(opts, in_file=bool(where))
    except ValueError as e:
        if not where:
            raise
        raise ValueError(f"{where}{e}") from None


def _grid_shapes(opts: dict, in_file: bool) -> list[ShapeSpec]:
    from tsdecode import validation as V

    def name(key: str) -> str:
        return key if in_file else "--" + key.replace("_", "-")

    unknown = [k for k in opts if k not in GRID_KEYS]
    if unknown:
        raise ValueError(f"unknown key(s) {unknown}; the keys are {list(GRID_KEYS)}")

    def get(key, default=None):
        value = opts.get(key)
        return default if value is None else value

    given = {k: _ints(get(k), name(k)) for k in ("batch_sizes", "kv_lens") if get(k) is not None}
    missing = [name(k) for k in ("batch_sizes", "kv_lens") if k not in given]
    if missing:
        raise ValueError(f"{missing[0]} missing: a custom grid needs both batch sizes and K/V lengths")
    batch_sizes, kv_lens = given["batch_sizes"], given["kv_lens"]
    heads = _heads(get("heads", "32:8"), name("heads"))
    head_dims = _ints(get("head_dim", "128"), name("head_dim"), single=True)
    page_sizes = _ints(get("page_sizes", "16"), name("page_sizes"))
    kv_dtypes = _dtype_names(get("kv_dtypes", "bfloat16"), name("kv_dtypes"))
    bad = [n for n in kv_dtypes if DTYPES[n] not in V.KV_DTYPES]
    if bad:
        raise ValueError(f"{name('kv_dtypes')}: {bad} cannot be a K/V cache dtype; one of "
                         f"{[dtype_name(d) for d in V.KV_DTYPES]}")
    q_given = get("q_dtype") is not None
    q_dtype = _dtype_names(get("q_dtype"), name("q_dtype"), single=True)[0] if q_given else None
    seq_len_q = _scalar(get("seq_len_q", 1), name("seq_len_q"), int, 1)
    window_left = _scalar(get("window_left", -1), name("window_left"), int, -1)
    packed = _scalar(get("packed", False), name("packed"), bool)
    ragged = _scalar(get("ragged", False), name("ragged"), bool)
    mask = get("mask", "dense")
    if mask not in ("dense", "causal"):
        raise ValueError(f"{name('mask')}: expected 'dense' or 'causal', got {mask!r}")
    if window_left >= 0 and mask != "causal":
        raise ValueError(f"{name('window_left')} {window_left} needs {name('mask')} causal")
    if mask == "causal" and seq_len_q > min(kv_lens):
        raise ValueError(f"{name('seq_len_q')} {seq_len_q} exceeds the shortest of {name('kv_lens')}, {min(kv_lens)}: "
                         f"a causal mask needs every request's query length <= its K/V length")
    for hq, hkv in heads:
        if hq < 1 or hkv < 1 or hq % hkv or hq // hkv > V.MAX_GROUP_SIZE:
            raise ValueError(f"{name('heads')}: {hq}:{hkv}: HQ must be a multiple of HKV (both "
                             f">= 1) with HQ/HKV <= {V.MAX_GROUP_SIZE}")
    sizes = (name("batch_sizes"), name("kv_lens"), name("seq_len_q"))
    try:  # the largest shape: the kernels index in int32 (a huge size would overflow a float later)
        V.validate_sizes(max(batch_sizes), max(kv_lens), seq_len_q, max(hq for hq, _ in heads), names=sizes,
                         head_dim=max(head_dims))
    except (ValueError, NotImplementedError) as e:
        int32 = str(e).startswith("B*SQ*Hq")
        raise ValueError(f"{sizes[0]}, {sizes[2]}, {name('heads')} and {name('head_dim')}: {e}" if int32
                         else str(e)) from None
    if window_left > V.MAX_KV_LEN:
        raise ValueError(f"{name('window_left')}: expected -1 (no window) or at most {V.MAX_KV_LEN} (the longest "
                         f"K/V length), got {window_left}")
    bad = [d for d in head_dims if d not in V.SUPPORTED_HEAD_DIMS]
    if bad:
        raise ValueError(f"{name('head_dim')}: {bad} not supported; one of "
                         f"{list(V.SUPPORTED_HEAD_DIMS)}")
    bad = [p for p in page_sizes if p > V.MAX_PAGE_SIZE]
    if bad:
        raise ValueError(f"{name('page_sizes')}: {bad} above the largest page size, "
                         f"{V.MAX_PAGE_SIZE}")
    specs = []
    for (hq, hkv), d, p, kv_dtype in itertools.product(heads, head_dims, page_sizes, kv_dtypes):
        q = q_dtype or ("bfloat16" if kv_dtype == "float8_e4m3fn" else kv_dtype)
        o_dtype = "bfloat16" if q == "float8_e4m3fn" else q
        try:
            V.resolve_dtypes(DTYPES[q], DTYPES[kv_dtype], DTYPES[o_dtype])
        except (TypeError, ValueError, NotImplementedError) as e:
            with_q = f" with {name('q_dtype')} {q}" if q_given else ""
            raise ValueError(f"{name('kv_dtypes')} {kv_dtype}{with_q}: {e}") from None
        specs += grid(
            batch_sizes, kv_lens, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=p,
            q_dtype=q, kv_dtype=kv_dtype, o_dtype=o_dtype, seq_len_q=seq_len_q, packed=packed,
            mask_type=mask, window_left=window_left, ragged=ragged,
        )
    return specs


def specs_from_args(args) -> list[ShapeSpec]:
    """The grid an argparse namespace from ``add_grid_arguments`` names (presets + file + flags),
    without duplicates, in order. Raises ValueError for a bad or empty grid."""
    specs: list[ShapeSpec] = []
    for name in args.preset or []:
        specs += preset(name)
    if args.grid_file:
        try:
            import tomllib
        except ImportError:  # Python 3.10: no TOML reader in the standard library
            raise ValueError(f"--grid-file {args.grid_file}: reading TOML needs Python >= 3.11 "
                             "(tomllib); pass the grid as flags instead") from None
        try:
            with open(args.grid_file, "rb") as f:
                data = tomllib.load(f)  # TOMLDecodeError is a ValueError
        except OSError as e:
            raise ValueError(f"--grid-file {args.grid_file}: cannot be read ({e.strerror or e})") from None
        except ValueError as e:
            raise ValueError(f"--grid-file {args.grid_file}: not TOML ({e})") from None
        tables = data.get("grid")
        others = [k for k in data if k != "grid"]
        if not isinstance(tables, list) or not tables or others:
            extra = f" (unknown top-level key(s) {others})" if others else ""
            raise ValueError(f"--grid-file {args.grid_file}: expected one or more [[grid]] tables{extra}")
        for i, table in enumerate(tables, 1):
            where = f"--grid-file {args.grid_file}: [[grid]] {i}: "
            if not isinstance(table, dict):
                raise ValueError(f"{where}expected a table of keys, got {table!r}")
            specs += _custom_grid(table, where)
    stray = [k for k in GRID_KEYS[2:] if getattr(args, k, None) not in (None, False)]
    if stray and args.batch_sizes is None and args.kv_lens is None:
        flag = "--" + stray[0].replace("_", "-")
        raise ValueError(f"{flag} shapes a custom grid only: give it with --batch-sizes and --kv-lens (a preset "
                         "and --grid-file have shapes of their own)")
    if args.batch_sizes is not None or args.kv_lens is not None:
        specs += _custom_grid({
            "batch_sizes": args.batch_sizes, "kv_lens": args.kv_lens, "heads": args.heads,
            "head_dim": args.head_dim, "page_sizes": args.page_sizes, "kv_dtypes": args.kv_dtypes,
            "q_dtype": args.q_dtype, "seq_len_q": args.seq_len_q, "packed": args.packed,
            "mask": args.mask, "window_left": args.window_left, "ragged": args.ragged,
        })
    if not specs:
        raise ValueError("empty shape grid: give --preset, --grid-file or --batch-sizes with --kv-lens")
    return list(dict.fromkeys(specs))
