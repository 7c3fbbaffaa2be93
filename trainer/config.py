"""The trainer's nodes of the typed config tree.

Each component owns its node here; the daemon composes them with its own node into the one tree
(``traind.daemon.config.Settings``). Every field says what it is where it is declared. Models are
strict (an unknown key is an error) and frozen (a config that crosses a process is a value).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from traind.errors import FieldError, FieldErrors
from traind.trainer.presets import PresetName, fill_preset

_NUMBERS = (int, float, int | None, float | None)
# Upper bounds of every integer setting: far past any real job, and inside what each reader
# holds (torch's int64 shapes, SQLite's INTEGER, a seed's 64 bits), so a slipped digit is an
# error naming its field at the start, not an overflow inside a worker minutes later.
STEPS_MAX = 10**12  # steps, and intervals counted in steps
COUNT_MAX = 2**24  # sizes and counts: tokens in a sequence, widths, layers, batches, queues
RANKS_MAX = 2**16  # ranks, nodes, threads and mesh degrees
SEED_MAX = 2**63 - 1
BYTES_MAX = 2**50
_INT64 = 2**63
# The json_schema_extra of a field only the host's owner may set (the daemon's config file or
# CLI, never the web API: daemon/experiments/specs.refuse_paths): it imports code. Fields that
# hold a Path are host-only by their type.
HOST_ONLY: dict[str, Any] = {"host_only": True}
# model.factory: "package.module:function", the entry-point notation of setuptools and uvicorn
FACTORY_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$"


class Node(BaseModel):
    """Base for every config node: unknown keys are rejected, values are immutable, numbers
    are finite and within 64 bits, and a boolean is never read as a number."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic's lax mode reads true as 1: `job.steps = true` would train one step.
        field = cls.model_fields.get(info.field_name or "")
        if isinstance(value, bool) and field is not None and field.annotation in _NUMBERS:
            raise ValueError(f"expected a number, got {str(value).lower()}")
        if isinstance(value, int) and not -_INT64 <= value < _INT64:
            # A run's config is stored and compared as JSON: keep integers a 64-bit store
            # holds (the database's, and every other tool's that reads it).
            raise ValueError("out of range: at most 2^63-1")
        return value


class JobConfig(Node):
    name: str = Field("default", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$",
                      description="Run name shown in the UI; letters, digits, '_', '.', '-'.")
    steps: int = Field(2000, gt=0, le=STEPS_MAX, description="Optimizer steps to train.")
    batch_size: int = Field(8, gt=0, le=COUNT_MAX,
                            description="Sequences per micro-batch per rank.")
    seed: int = Field(0, ge=0, le=SEED_MAX, description="Seed for weights, data order and dropout.")
    eval_every: int = Field(50, gt=0, le=STEPS_MAX,
                            description="Steps between validation-loss evaluations.")
    eval_batches: int = Field(4, gt=0, le=COUNT_MAX,
                              description="Batches averaged for one validation loss.")
    checkpoint_every: int = Field(200, gt=0, le=STEPS_MAX, description="Steps between checkpoints.")
    keep_last: int = Field(3, ge=0, le=COUNT_MAX,
                           description="Complete checkpoints kept (the newest); older "
                           "ones are deleted. 0 = keep all.")
    nproc_per_node: int = Field(1, gt=0, le=RANKS_MAX,
                                description="Worker ranks per node launched by "
                                "torchrun (one per GPU, or N CPU ranks with gloo). `traind "
                                "serve` given no config file runs 2 where the node has the "
                                "GPUs or CPUs for them (daemon/admission.py shipped_job).")
    nnodes: int = Field(1, gt=0, le=RANKS_MAX,
                        description="Nodes in the job; >1 needs rdzv_endpoint.")
    rdzv_endpoint: str | None = Field(None, description="host:port of the c10d rendezvous "
                                      "for multi-node jobs (the same on every node).")
    local_addr: str | None = Field(None, description="This node's address for the rendezvous "
                                   "and the ranks' store (multi-node; the daemon sets it from "
                                   "daemon.node_addr). Unset: torchrun looks up the host name.")
    out_dir: Path | None = Field(None, description="Checkpoint and log folder; the daemon "
                                 "chooses var/runs/<id> when unset.")
    resume: bool = Field(True, description="Resume from the newest checkpoint in out_dir.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="'auto' takes CUDA when "
                                                   "present, else the CPU.")
    threads: int = Field(0, ge=0, le=RANKS_MAX,
                         description="torch intra-op threads per rank; 0 = the "
                         "CPUs this process may use (affinity, capped by the cgroup CPU quota) "
                         "divided by the ranks on this node, at least 1 (trainer/threads.py).")
    max_restarts: int = Field(0, ge=0, le=COUNT_MAX,
                              description="Times torchrun restarts the ranks after "
                              "one fails (each resumes from the last complete checkpoint); "
                              "0 = the first failure ends the job.")
    compile: bool | Literal["auto"] = Field(
        "auto", description="torch.compile each transformer block (torchtitan's per-block "
        "compile); a compile failure falls back to eager with one warning. auto = on for "
        "CUDA; on the CPU only where the one-off compile (tens of seconds) pays back: steps "
        "of 4+ GFLOP and jobs of 4000+ steps (trainer/compile.py has the measurements).")


    @model_validator(mode="after")
    def _multi_node_needs_rendezvous(self) -> JobConfig:
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError("rdzv_endpoint (host:port) is required when nnodes > 1")
        return self


# How attend() runs a sliding window; trainer/attention.py maps each name to its function.
AttentionBackend = Literal["auto", "sdpa_mask", "flex", "triton"]


class HFConfig(Node):
    """A Hugging Face causal LM by architecture and config (trainer/hf.py): transformers'
    own model class, no module of the user's. Nothing is downloaded."""

    path: Path | None = Field(None, description="A local config.json, or a folder holding "
                              "one (and the *.safetensors weights that model.hf.weights "
                              "loads). Config file and CLI only.")
    config: dict[str, Any] = Field(
        default_factory=dict, json_schema_extra=HOST_ONLY,
        description="Config fields inline, over the file's: model_type ('llama', 'gpt2', "
        "'qwen2', ...) and its sizes (hidden_size, num_hidden_layers, ...). The vocabulary "
        "is traind's (model.vocab_size). Config file and CLI only.")
    weights: bool = Field(False, description="Load the folder's safetensors weights: a "
                          "trained model to go on training.")

    @model_validator(mode="after")
    def _names_a_model(self) -> HFConfig:
        if self.path is None and "model_type" not in self.config:
            raise FieldErrors.at(("config",), "model_type is needed without a path (e.g. "
                                 "'llama', 'gpt2', 'qwen2')")
        if self.weights and self.path is None:
            raise FieldErrors.at(("weights",), "weights are read from model.hf.path's folder: "
                                 "set model.hf.path")
        return self


class ModelConfig(Node):
    preset: PresetName = Field("custom", description="A named model shape (trainer/"
        "presets.py): debug, 60m, 125m, 350m, 1b (the parameter count at a 32000-token "
        "vocabulary, untied). It fills d_model, n_layers, n_heads, n_kv_heads and mlp_hidden, "
        "each only where the config does not set it: a field set explicitly wins. It never "
        "sets vocab_size or seq_len. custom = the fields as given.")
    vocab_size: int = Field(256, gt=0, le=COUNT_MAX, description="Byte-level tokens: 256.")
    seq_len: int = Field(128, gt=1, le=COUNT_MAX, description="Context length in tokens.")
    d_model: int = Field(128, gt=0, le=COUNT_MAX, description="Residual stream width.")
    n_layers: int = Field(4, gt=0, le=COUNT_MAX, description="Transformer blocks.")
    n_heads: int = Field(4, gt=0, le=COUNT_MAX, description="Attention heads; must divide d_model.")
    n_kv_heads: int = Field(0, ge=0, le=COUNT_MAX,
                            description="Key/value heads (grouped-query attention: "
                            "each serves n_heads / n_kv_heads query heads); must divide "
                            "n_heads. 0 = n_heads (multi-head attention); 1 = multi-query.")
    mlp_hidden: int = Field(0, ge=0, le=COUNT_MAX,
                            description="SwiGLU hidden width; 0 = 8/3·d_model "
                            "rounded up to a multiple of 32.")
    rope_theta: float = Field(10000.0, gt=0, description="RoPE base frequency.")
    tie_embeddings: bool = Field(False, description="The output head shares the token "
                                 "embedding's weight (one parameter; GPT-2, Llama 3.2 1B). "
                                 "Default untied (trainer/model.py says why); not with "
                                 "parallel.tp > 1 or pp > 1.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout after attention and MLP.")
    attention: Literal["full", "sliding_window"] = Field("full", description="Causal full "
                                                         "attention, or a sliding window.")
    window: int = Field(64, gt=0, le=COUNT_MAX,
                        description="sliding_window: each token sees this many "
                        "previous tokens (itself included).")
    global_tokens: int = Field(0, ge=0, le=COUNT_MAX,
                               description="sliding_window: the first N tokens are "
                               "seen by every later token (attention sinks).")
    attention_backend: AttentionBackend = Field(
        "auto", description="sliding_window: which implementation runs. auto = the fastest "
        "of those that can run, measured at the first call of each shape (trainer/"
        "attention_choice.py); sdpa_mask = SDPA with a boolean mask (the one with dropout); "
        "flex = flex_attention (compiled on CUDA); triton = the kernel in kernels/swa.py "
        "(CUDA; its SDPA twin elsewhere).")
    activation_checkpointing: bool = Field(False, description="Recompute each block's "
                                           "activations in backward instead of storing them.")
    activation_offload: bool = Field(False, description="Keep saved activations in host "
                                     "memory between forward and backward.")
    factory: str | None = Field(
        None, pattern=FACTORY_PATTERN, json_schema_extra=HOST_ONLY,
        description="Your own model instead of traind's: 'package.module:function' returning "
        "an nn.Module from token ids to logits (or a loss), called with the model.* fields "
        "its parameters name (trainer/factory.py). Config file and CLI only.")
    hf: HFConfig | None = Field(None, description="A Hugging Face causal LM instead of "
                                "traind's (trainer/hf.py): model.hf.path and/or "
                                "model.hf.config; transformers must be installed.")

    @model_validator(mode="before")
    @classmethod
    def _fill_preset(cls, data: Any) -> Any:
        # before validation, on the raw keys: only a key the config leaves out is filled
        return fill_preset(data) if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _heads_divide_width(self) -> ModelConfig:
        if self.d_model % self.n_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must divide d_model ({self.d_model})")
        if (self.d_model // self.n_heads) % 2:
            raise ValueError("d_model / n_heads must be even for RoPE")
        if self.n_heads % self.kv_heads:
            raise FieldErrors.at(("n_kv_heads",), f"{self.n_kv_heads} must divide n_heads "
                                 f"({self.n_heads}): each kv head serves a whole group of "
                                 "query heads")
        return self

    @property
    def kv_heads(self) -> int:
        """The key/value heads the model has: ``n_kv_heads``, or ``n_heads`` for 0."""
        return self.n_kv_heads or self.n_heads

    @model_validator(mode="after")
    def _backend_has_dropout(self) -> ModelConfig:
        if self.dropout and self.attention_backend in ("flex", "triton"):
            raise ValueError(f"attention_backend {self.attention_backend!r} has no dropout "
                             f"(dropout = {self.dropout}); use 'auto' or 'sdpa_mask'")
        return self

    @model_validator(mode="after")
    def _factory_saves_its_own_memory(self) -> ModelConfig:
        # traind's memory savers wrap its own blocks' calls (model.run_blocks); a factory's
        # forward is its own, so they would silently do nothing
        if self.factory is not None and self.hf is not None:
            raise FieldErrors.at(("hf",), "model.factory and model.hf both name the model: "
                                 "keep one")
        if self.user_field is not None and (
                self.activation_checkpointing or self.activation_offload):
            raise ValueError("activation_checkpointing and activation_offload apply to "
                             f"traind's own model; a model.{self.user_field[1]} model saves "
                             "memory in its own forward")
        return self

    @property
    def user_field(self) -> tuple[str, str] | None:
        """The field that brings a model other than traind's own (``("model", "factory")`` or
        ``("model", "hf")``); None for traind's GPT. Where a refusal of it is named."""
        if self.factory is not None:
            return ("model", "factory")
        return ("model", "hf") if self.hf is not None else None


class FilterConfig(Node):
    """What ``traind data prepare`` leaves out (data/filters.py applies it). The defaults were
    measured on the default corpus (Python 3.11's stdlib, 799 files, 12.6 MB): none of its
    files crosses a quality threshold, and the near-duplicates are the generated codec tables
    of encodings/ (22 files, each >= 0.67 estimated Jaccard to an earlier table)."""

    near_duplicates: bool = Field(True, description="Drop near-duplicate documents: MinHash "
                                  "signatures of word shingles, LSH at near_threshold.")
    # stdlib: 22 of 799 files dropped (2.8%), all encodings/cp*, iso8859_*, mac_* tables
    near_threshold: float = Field(0.8, gt=0, le=1, description="Estimated Jaccard similarity "
                                  "of shingle sets at which a document is a near-duplicate "
                                  "of one kept before it.")
    shingle_words: int = Field(5, gt=0, le=COUNT_MAX, description="Words per shingle for MinHash.")
    num_perm: int = Field(128, ge=16, le=1024, description="MinHash permutations.")
    # stdlib bits/char: min 3.79, 1st pct 4.02, median 4.50, max 5.33; "aaaa..." is 0
    min_entropy: float = Field(3.0, ge=0, description="Least character entropy (bits per "
                               "character); lower is left out as low_entropy. 0 = off.")
    # stdlib: median 0.08, 99th pct 0.33, max 0.45 (bisect.py); a line 100 times is 0.99
    max_repetition: float = Field(0.5, gt=0, le=1, description="Largest share of a "
                                  "document's lines that repeat an earlier line of it; more "
                                  "is left out as repetitive. 1 = off.")
    # stdlib: 0 in every file; the tests' planted file with control characters scores 0.17
    max_non_text: float = Field(0.1, ge=0, le=1, description="Largest share of characters "
                                "that are not text (control characters, U+FFFD); more is "
                                "left out as non_text. 1 = off.")


class DataConfig(Node):
    paths: list[Path] = Field(default_factory=list, description="Text files or folders; empty "
                              "= the Python standard library's own source (on every machine).")
    glob: str = Field("**/*.py", description="Pattern for files inside folders in paths "
                      "(and for the default corpus).")
    max_bytes: int = Field(32 * 2**20, gt=0, le=BYTES_MAX, description="Corpus size cap in bytes.")
    val_fraction: float = Field(0.05, gt=0, lt=0.5, description="Held-out share for "
                                "validation, taken from the end of the corpus.")
    min_doc_bytes: int = Field(16, ge=0, le=BYTES_MAX,
                               description="Files shorter than this are left out "
                               "of the corpus (filtered as too_short); 0 = off.")
    cache_dir: Path | None = Field(None, description="Folder caching each file's filter "
                                   "result across runs; unset = in-process memory only.")
    order: int = Field(0, ge=0, le=SEED_MAX,
                       description="Which order of training batches: 0 = job.seed's "
                       "own; k > 0 draws every batch from (job.seed, k) instead (a resumed job "
                       "continues at its batch index in that order). A forked experiment gives "
                       "repeat r of every arm order r + 1: the arms of one repeat see the same "
                       "batches (paired), and repeats sample different ones.")
    tokenizer: Literal["bytes", "bpe"] = Field("bytes", description="bytes: raw UTF-8 bytes "
                                              "(vocab 256); bpe: the byte-level BPE in "
                                              "data.tokenizer_file (traind data tokenizer "
                                              "train makes one). model.vocab_size follows it.")
    tokenizer_file: Path | None = Field(None, description="data.tokenizer = bpe: a Hugging "
                                        "Face tokenizer.json (config file or CLI only).")
    shards: Path | None = Field(None, description="A folder traind data prepare wrote: train "
                                "from its token shards (tokenizer and split included) instead "
                                "of reading data.paths at start.")
    filter: FilterConfig = Field(default_factory=FilterConfig)
    prefetch: Annotated[int, Field(ge=0)] | Literal["auto"] = Field(
        "auto", description="Batches a background thread prepares ahead of the loop; 0 = "
        "drawn in the loop itself; auto = 2 on CUDA, 0 on the CPU (where the thread cost 10% "
        "of a step in bench/speed.py and a batch takes well under a millisecond to draw).")

    @field_validator("glob")
    @classmethod
    def _glob_stays_inside(cls, pattern: str) -> str:
        # The pattern is matched under each folder of paths: it may not climb out of it (an
        # API override could otherwise read any file the daemon can).
        parts = pattern.replace("\\", "/").split("/")
        if not pattern or pattern.startswith(("/", "~")) or ".." in parts:
            raise ValueError(f"{pattern!r} must be a relative pattern that stays inside the "
                             "data folders (no leading / or ~, no ..)")
        return pattern


class OptimConfig(Node):
    lr: float = Field(3e-3, gt=0, description="Peak learning rate.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Final lr as a share of lr.")
    warmup_steps: int = Field(50, ge=0, le=STEPS_MAX, description="Linear warm-up steps.")
    weight_decay: float = Field(0.1, ge=0, description="AdamW decoupled weight decay "
                                "(matrices only).")
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    grad_clip: float = Field(1.0, ge=0, description="Global grad-norm clip; 0 = off.")


# The one definition of each list a user picks from; the daemon, the web forms and the tuner
# take theirs from here (and trainer/compression's registry has a class for each method).
PrecisionMode = Literal["fp32", "bf16", "fp16", "fp8", "adaptive"]
# Modes that are autocast alone (no loss scaler, no swapped layers): a running job switches
# between them at a step boundary (A/B arms, promoted settings).
SwitchablePrecision = Literal["fp32", "bf16"]
CompressionMethod = Literal["none", "fp16", "bf16", "int8", "topk", "powersgd"]
ParallelStrategy = Literal["ddp", "zero1", "fsdp", "hsdp"]
# trainer/pipeline_parallel.py maps each name to its torch.distributed.pipelining schedule
PipelineScheduleName = Literal["gpipe", "1f1b", "interleaved_1f1b"]
PRECISION_MODES: tuple[str, ...] = get_args(PrecisionMode)
SWITCHABLE_PRECISIONS: tuple[str, ...] = get_args(SwitchablePrecision)
COMPRESSION_METHODS: tuple[str, ...] = get_args(CompressionMethod)
# The strategies that wrap the model in DDP (trainer/parallel.py), whose communication hook
# is where gradient compression runs.
DDP_STRATEGIES: tuple[str, ...] = ("ddp", "zero1")


def compression_unavailable(method: str, *, strategy: str, ranks: int,
                            single_rank_group: bool = False, tp: int = 1,
                            pp: int = 1) -> str | None:
    """Why compression ``method`` cannot run in a job of ``ranks`` ranks under
    ``parallel.strategy`` ``strategy`` (None: it can). The one home of the rule "compression
    needs DDP", checked by the trainer, the daemon's experiments and the tuner alike.

    The reason starts with the method (callers put the field it came from in front) and
    names every field that must change; ``single_rank_group`` (``parallel.single_rank_group``)
    gives one rank a DDP wrap of its own. With ``tp`` (``parallel.tp``) > 1 the dp dimension
    is never DDP (trainer/mesh.py says why), so only ``none`` runs there; nor with ``pp``
    (``parallel.pp``) > 1 yet."""
    if method == "none":  # a plain averaged all-reduce: any job runs it
        return None
    needs = []
    if ranks < 2 and not single_rank_group:
        needs.append(f"more than one rank (job.nproc_per_node x job.nnodes = {ranks})")
    if strategy not in DDP_STRATEGIES:
        needs.append(f"parallel.strategy ddp or zero1 (not {strategy!r})")
    if tp > 1:
        needs.append(f"parallel.tp = 1 (not {tp}: with tensor parallel the dp dimension is "
                     "FSDP2's replicate or fully_shard, which have no DDP communication hook)")
    if pp > 1:
        needs.append(f"parallel.pp = 1 (not {pp}: gradient compression with pipeline "
                     "parallel is not yet supported)")
    if not needs:
        return None
    return (f"{method!r} compresses DDP's gradient all-reduce, so it needs DDP: "
            + " and ".join(needs))


class PrecisionConfig(Node):
    mode: PrecisionMode = Field(
        "fp32", description="Compute precision; master weights and optimizer state stay fp32. "
        "fp16 adds a GradScaler; fp8 needs torchao and a GPU with fp8 tensor cores (on the CPU "
        "it runs in torchao's emulation, for tests); adaptive "
        "switches each parameter group by its gradient signal-to-noise ratio.")
    low: Literal["bf16", "fp16"] = Field("bf16", description="adaptive: the lower precision "
                                         "a group drops to.")
    snr_window: int = Field(16, gt=1, le=COUNT_MAX,
                            description="adaptive: steps over which a group's "
                            "gradient SNR is measured: mean^2 / var of the group's gradient "
                            "norm over the window (1 / its squared coefficient of variation).")
    # Defaults from the default job (bench/adaptive_precision.py): the SNR's median rises from
    # ~15-30 in the first 400 steps to ~80-110 later; its 10th percentile from 1-3 to 20-50.
    snr_high: float = Field(30.0, gt=0, description="adaptive: above this SNR (the norm "
                            "varies by less than ~18%) a group drops to the lower precision.")
    snr_low: float = Field(3.0, gt=0, description="adaptive: below this SNR (it varies by more "
                           "than ~58%) it returns to fp32 (snr_low < snr_high: the gap is the "
                           "hysteresis).")
    min_dwell: int = Field(32, ge=0, le=STEPS_MAX,
                           description="adaptive: steps a group stays in a mode "
                           "before it may switch again.")
    init_scale: float = Field(2.0**16, gt=0, description="fp16: GradScaler's first scale.")
    fp8_recipe: Literal["tensorwise", "rowwise"] = Field(
        "tensorwise", description="fp8: torchao's float8 scaling recipe; tensorwise (one scale "
        "per tensor, the fastest) or rowwise (one per row, more accurate; needs CUDA 12.4+ "
        "fp8 rowwise kernels on a GPU).")

    @model_validator(mode="after")
    def _hysteresis(self) -> PrecisionConfig:
        if self.snr_low >= self.snr_high:
            raise ValueError(f"snr_low ({self.snr_low}) must be below snr_high "
                             f"({self.snr_high})")
        return self


class CompressionConfig(Node):
    method: CompressionMethod = Field(
        "none", description="Gradient compression in the DDP communication hook.")
    error_feedback: bool = Field(True, description="int8/topk: carry what compression lost "
                                 "into the next step.")
    int8_block: int = Field(256, gt=0, le=COUNT_MAX, description="int8: elements per scale block.")
    topk_ratio: float = Field(0.01, gt=0, le=1, description="topk: share of elements sent.")
    powersgd_rank: int = Field(2, gt=0, le=COUNT_MAX,
                               description="powersgd: matrix approximation rank.")
    powersgd_start_step: int = Field(10, ge=1, le=STEPS_MAX,
                                     description="powersgd: plain all-reduce "
                                     "before this step (PowerSGD's warm-up).")
    powersgd_warm_start: bool = Field(True, description="powersgd: reuse Q between steps.")
    debug_wait: bool = Field(False, description="Debug only: wait for each bucket's "
                             "collectives inside backward (no overlap; timings serialized).")


class ParallelConfig(Node):
    strategy: ParallelStrategy = Field("ddp", description="How the dp dimension holds the "
        "model. ddp: DistributedDataParallel (with tp or pp: FSDP2's replicate); zero1: ddp "
        "with the optimizer state sharded over dp (ZeroRedundancyOptimizer; with tp or pp "
        "traind's own, trainer/zero.py); fsdp: FSDP2 fully_shard per transformer block over "
        "every dp rank; hsdp: FSDP2 sharded over parallel.dp_shard ranks (one node's) and "
        "replicated across the groups of them (between nodes).")
    bucket_mb: float = Field(25.0, gt=0, description="DDP gradient bucket size in MiB.")
    grad_accum: int = Field(1, gt=0, le=COUNT_MAX, description="Micro-batches (of job.batch_size) "
                            "accumulated per optimizer step.")
    fsdp_reduce_dtype: Literal["fp32", "bf16"] = Field("fp32", description="fsdp under a "
        "low precision: the dtype gradients are reduce-scattered in (parameters are "
        "all-gathered in the compute dtype). fp32 keeps the sum exact; bf16 halves the traffic.")
    single_rank_group: bool = Field(False, description="With one rank, still form a process "
        "group and wrap the model in the strategy (DDP and its communication hook, FSDP): "
        "their real path on one GPU or CPU, for checks; off, one rank trains unwrapped.")
    sharded_checkpoints: bool = Field(False, description="Write checkpoints with "
                                      "torch.distributed.checkpoint (a folder of shards); "
                                      "fsdp and tp > 1 always do.")
    # The mesh (trainer/mesh.py): dp x tp x pp = the world size; tp varies fastest, so a tp
    # group is consecutive ranks (on GPUs: one node's, linked by NVLink, where it talks most).
    dp: int | None = Field(None, ge=0, le=RANKS_MAX,
                           description="Data-parallel degree: ranks that see "
                           "different batches, over which parallel.strategy shards or "
                           "replicates. None or 0 = inferred, world size / (tp * pp).")
    tp: int = Field(1, ge=1, le=RANKS_MAX,
                    description="Tensor-parallel degree: ranks that split each "
                    "block's attention heads and SwiGLU hidden units (DTensor, "
                    "trainer/tensor_parallel.py); they see the same batch. Must divide "
                    "model.n_heads, the MLP hidden width, model.vocab_size and model.seq_len.")
    dp_shard: int = Field(0, ge=0, le=RANKS_MAX, description="hsdp: the dp ranks each parameter is "
                          "sharded over (consecutive ranks: one node's, on the fast links); "
                          "the dp / dp_shard groups of them replicate it, exchanging only "
                          "an all-reduce of the gradient shards. 0 = the dp ranks of one node "
                          "(job.nproc_per_node / tp of them). Must divide dp.")
    pp: int = Field(1, ge=1, le=RANKS_MAX,
                    description="Pipeline-parallel degree: stages of consecutive "
                    "blocks (the first also holds the embedding, the last the final norm, "
                    "head and loss), one per pp rank, run by torch.distributed.pipelining "
                    "(trainer/pipeline_parallel.py). At most model.n_layers.")
    pp_schedule: PipelineScheduleName = Field("1f1b", description="pp > 1: the order of "
        "micro-batch forwards and backwards. gpipe: all forwards, then all backwards (holds "
        "every micro-batch's activations); 1f1b: one forward, one backward in the steady "
        "state (at most pp micro-batches in flight); both idle (pp-1)/(m+pp-1) of a step, "
        "m = parallel.microbatches. interleaved_1f1b: looped stages, each rank holds "
        "parallel.pp_virtual_stages of them (rank r: stages r, r + pp, ...), so the bubble "
        "shrinks to (pp-1)/(v*m+pp-1) at the price of v times the activation sends.")
    pp_virtual_stages: int = Field(2, ge=2, le=COUNT_MAX,
                                   description="interleaved_1f1b: stages per rank "
                                   "(v); pp x v must be at most model.n_layers.")
    microbatches: int = Field(0, ge=0, le=COUNT_MAX,
                              description="pp > 1: micro-batches each batch of "
                              "job.batch_size is split into for the pipeline (must divide "
                              "it); more of them shrink the bubble. 1f1b needs at least pp. "
                              "0 = derived (trainer/mesh.py's default_microbatches): pp when "
                              "it divides job.batch_size, else one per sequence.")
    # Placement (trainer/placement.py) from the link probe (trainer/linkprobe.py).
    placement: Literal["fixed", "auto"] = Field("fixed", description="Which rank takes which "
        "mesh coordinate. fixed: rank order (tp groups are consecutive ranks, which torchrun "
        "numbers node by node, so tp stays inside a node as long as tp divides "
        "job.nproc_per_node). auto: probe the links at start (point to point, every pair; "
        "0.35 s for 4 gloo ranks on a loaded 2-core host) and lay tp over the fastest groups "
        "of ranks, pp across the slowest links, dp over the rest; it leaves the fixed order "
        "only when that is clearly faster. Default fixed: the common case is already right, "
        "and auto costs the probe at every start (on GPUs too: one NCCL pair per round).")
    link_probe: bool = Field(False, description="Probe the rank-to-rank links at job start "
        "even with placement fixed (auto always does, with more than one rank): the latency "
        "and bandwidth matrix is exported (traind_link_*) and drawn on /comm.")


class ArmConfig(Node):
    name: str = Field(min_length=1, max_length=32, pattern=r"^[A-Za-z0-9_.-]+$",
                      description="Arm name (a label on its metrics).")
    compression: dict[str, Any] = Field(default_factory=dict, description="compression.* "
                                        "fields this arm overrides, e.g. {method='int8'}.")
    precision: SwitchablePrecision | None = Field(None, description="Compute precision "
                                                      "of this arm (stateless modes only).")
    slowdown: float = Field(0.0, ge=0, le=1, description="Benchmark calibration: the arm "
                            "sleeps this fraction of each step's compute time, a known "
                            "slowdown (bench/ab_calibration.py plants it); 0 = none.")


class InterleaveConfig(Node):
    """Interleaved A/B arms inside one running job: arms alternate in blocks of steps in a
    balanced order (A B B A ...), so slow drift of the machine falls on every arm alike."""

    arms: list[ArmConfig] = Field(default_factory=list, description="Two or more arms; "
                                  "empty = no interleaving. The first is the baseline.")
    block_steps: int = Field(20, gt=1, le=STEPS_MAX, description="Steps per block.")
    warmup_steps: int = Field(3, ge=0, le=STEPS_MAX,
                              description="Steps after each switch left out of the "
                              "block's measurement.")
    loss_margin: float = Field(0.05, gt=0, description="Quality guard, an ABSOLUTE margin "
                               "in nats of loss (not relative): an arm's block loss may sit at "
                               "most this far above the baseline's (0.05: a loss of 2.00 vs "
                               "2.05 passes).")
    min_effect: float = Field(0.02, gt=0, lt=1, description="The smallest speed-up worth "
                              "having, relative (0.02 = 2%): the sequential test stops for "
                              "futility once an arm cannot reach it.")
    equivalence: float = Field(0.02, gt=0, lt=1, description="The \"no difference\" band, "
                               "relative (0.02 = +-2%): an arm whose ratio is shown inside it "
                               "is equal to the baseline. Tighter than the node's block noise, "
                               "it needs many pairs (the experiment form says how many).")

    @model_validator(mode="after")
    def _arms(self) -> InterleaveConfig:
        if len(self.arms) == 1:
            raise ValueError("arms: give two or more (the first is the baseline), or none")
        names = [a.name for a in self.arms]
        if len(set(names)) != len(names):
            raise ValueError(f"arms: names must be unique, got {names}")
        if self.warmup_steps >= self.block_steps:
            raise ValueError("warmup_steps must be below block_steps")
        return self


class TelemetryConfig(Node):
    every: int = Field(1, gt=0, le=STEPS_MAX,
                       description="Steps between reading loss and norms on the "
                       "host (the only host-device sync telemetry adds).")
    per_layer: bool = Field(True, description="Per-layer grad norm, weight norm and "
                            "update-to-weight ratio.")
    layer_every: int = Field(10, gt=0, le=STEPS_MAX,
                             description="Steps between per-layer reports (each "
                             "copies the weights once to measure the update).")
    collectives: bool = Field(True, description="Per-collective calls, bytes and latency by "
                              "op and message size from DDP's hook (the NCCL Inspector's "
                              "figures; bench/overhead.py --ranks 2 prints their cost); "
                              "false: the hook times and reports none.")
    probe_every: int = Field(0, ge=0, le=STEPS_MAX,
                             description="Steps between all-reduce probes (latency "
                             "and bandwidth per message size); 0 = off.")
    probe_sizes: list[int] = Field(default_factory=lambda: [4 << 10, 256 << 10, 4 << 20,
                                                            64 << 20],
                                   description="Probe message sizes in bytes (4 KiB..64 MiB).")
    probe_repeats: int = Field(5, gt=0, le=COUNT_MAX, description="All-reduces per size per probe.")
    queue_size: int = Field(4096, gt=0, le=COUNT_MAX,
                            description="Events buffered in the worker before "
                            "new ones are dropped (and counted).")


class NumericsConfig(Node):
    """What a job does about NaN/Inf losses or gradients and loss spikes. Any policy but off
    reads the loss on the host every step (one tiny all-reduce with several ranks)."""

    policy: Literal["off", "fail", "skip_step", "rollback"] = Field(
        "off", description="off: no checks (the fp16 scaler still skips inf gradients); fail: "
        "end the run with an error; skip_step: drop the step's update; rollback: restore the "
        "last checkpoint and skip the batches trained on since (job.out_dir is needed).")
    spike_sigmas: float = Field(6.0, ge=0, description="A loss above mean + k standard "
                                "deviations of the recent losses is a spike; 0 = no spike "
                                "check.")
    spike_window: int = Field(50, gt=1, le=COUNT_MAX,
                              description="Recent losses the spike check keeps; "
                              "it starts once the window is full.")
    max_rollbacks: int = Field(3, gt=0, le=COUNT_MAX,
                               description="rollback: rollbacks without a new "
                               "checkpoint in between before the run fails instead.")


class TrainConfig(Node):
    """Everything one training job needs; what crosses into a worker process."""

    job: JobConfig = JobConfig()
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    optim: OptimConfig = OptimConfig()
    precision: PrecisionConfig = PrecisionConfig()
    compression: CompressionConfig = CompressionConfig()
    parallel: ParallelConfig = ParallelConfig()
    interleave: InterleaveConfig = InterleaveConfig()
    telemetry: TelemetryConfig = TelemetryConfig()
    numerics: NumericsConfig = NumericsConfig()

    @model_validator(mode="after")
    def _mesh_is_valid(self) -> TrainConfig:
        # The rules are trainer/mesh.py's (one home, also checked at start-up against the
        # ranks torchrun really gave); here against the ranks the job asks for.
        from traind.trainer.mesh import mesh_problems

        if problems := mesh_problems(self, world=self.job.nproc_per_node * self.job.nnodes):
            raise FieldErrors(problems)
        return self

    @model_validator(mode="after")
    def _arm_overrides_are_valid(self) -> TrainConfig:
        problems: list[FieldError] = []
        for i, arm in enumerate(self.interleave.arms):
            try:
                self.arm_compression(arm)
            except ValidationError as exc:
                # Paths below this model: pydantic would put the error at the root, so the
                # paths travel inside the error (the config loader reads them back out).
                problems += [(("interleave", "arms", i, "compression", *e["loc"]), e["msg"])
                             for e in exc.errors()]
        if problems:
            raise FieldErrors(problems)
        return self

    def arm_compression(self, arm: ArmConfig) -> CompressionConfig:
        """The compression node as ``arm`` runs it: the job's, with the arm's overrides."""
        return CompressionConfig.model_validate({**self.compression.model_dump(),
                                                 **arm.compression})
