"""The experiment configuration: typed, frozen sections, every field declared once.

Each field is declared with its default and its help text (`_field`); `async_rl.cli`
turns these dataclasses into the ConfigDicts config files start from, parses the command
line, and writes the key reference (docs/config.md). Library code only sees the
dataclasses, each component the section it owns. A field's bounds that concern the config
alone are checked here, naming the field; a bound that a component owns (the loss's clip
ranges, a task's lengths) is checked by that component, and the builder
(`rl.build.preflight`) runs those checks before anything is compiled. Every set of names
a field may take lives here as a tuple.

This module is a leaf: it imports only the standard library, and it reads no files:
resolving a Hugging Face directory or checking a data path is the builder's job.
"""

import dataclasses
import json
import math
import re
from typing import Any, Optional

# The names fields may take.
DTYPES = ("float32", "bfloat16", "float16")
# How the rotary frequencies are scaled: not at all, or as Llama 3.1/3.2 do (the low
# frequencies divided by a factor, the high ones kept, a smooth blend between).
ROPE_SCALINGS = ("none", "llama3")
# Per layer and token, what `model.remat_saves` may keep from the forward pass (the
# rest is recomputed in the backward pass), and the matmul that keeping it saves
# recomputing: the rotated q, k and v (D (H + 2K) E elements; their projection), the
# residual stream between attention and MLP (D; the output projection), and the MLP's
# gate and up projections (F each; their matmuls).
REMAT_SAVES = ("qkv", "residual", "mlp_gate", "mlp_up")
SCHEDULES = ("constant", "cosine")
PROX_LOGP = ("recompute", "loglinear", "behav")
IMPORTANCE_LEVELS = ("token", "sequence")
REJECTION_LEVELS = ("token", "sequence")
REJECTION_ACTIONS = ("mask", "clamp")
REJECTION_METRICS = ("ratio", "kl_k1", "kl_k2", "kl_k3")
# Schulman's estimators of KL(π || π_ref) on sampled tokens, and where the penalty goes.
KL_ESTIMATORS = ("k1", "k2", "k3")
KL_PLACEMENTS = ("loss", "reward")
ADVANTAGE_LEVELS = ("group", "batch", None)
UPDATE_MODES = ("retract", "keep", "drain")
ON_STALE = ("drop", "mask_tokens", "admit")
PLACEMENTS = ("in_process", "ray")
# How a reward function is called (`rewards.adapters`): "auto" decides by its signature.
REWARD_STYLES = ("auto", "single", "trl", "verl")
# The tokenizers of the data task: the model's own ("hf") or UTF-8 bytes ("bytes").
DATA_TOKENIZERS = ("hf", "bytes")
# What a resumed run may change without `run.allow_config_change`: dotted field names,
# or section names for all their fields.
RESUMABLE_FIELDS = ("num_steps", "run", "checkpoint", "eval", "log", "placement", "cpu")
# Fields of `model` that stay the run's own with `hf_model_dir`: numerics and length,
# not architecture.
HF_RUN_MODEL_FIELDS = ("max_seq_len", "dtype", "param_dtype", "remat", "remat_saves")


def _field(default, doc: str):
  """A config field: its default and its help (the key reference, `--print_config`)."""
  if isinstance(default, dict):  # every config gets its own mapping
    return dataclasses.field(default_factory=lambda: dict(default), metadata={"help": doc})
  return dataclasses.field(default=default, metadata={"help": doc})


def fail(field: str, value, why: str):
  """Raises the ValueError a config field's bad value gets."""
  raise ValueError(f"{field} {why}, got {value!r}")


def _check_choice(field, value, choices):
  if value not in choices:
    fail(field, value, f"must be one of {choices}")


def _check_finite(section, obj):
  """Every float field of `obj` must be finite (NaN passes every `<` check)."""
  for f in dataclasses.fields(obj):
    value = getattr(obj, f.name)
    if isinstance(value, float) and not math.isfinite(value):
      fail(f"{section}.{f.name}", value, "must be finite")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shape and numerics of a Qwen2, Qwen3 or Llama decoder (a Llama layer has neither
  `qkv_bias` nor `qk_norm`)."""
  vocab_size: int = _field(256, "token ids the model embeds and predicts (V).")
  d_model: int = _field(128, "the width of the residual stream (D).")
  n_layers: int = _field(4, "transformer layers (L).")
  n_heads: int = _field(4, "query heads per layer (H).")
  n_kv_heads: int = _field(2, "key/value heads per layer (K; grouped-query attention when < H).")
  head_dim: int = _field(32, "the width of one head (E).")
  d_ff: int = _field(512, "the MLP's hidden width (F).")
  rope_theta: float = _field(10000.0, "the base of the rotary position embedding.")
  rope_scaling: str = _field(
      "none", "how the rotary frequencies are scaled (`ROPE_SCALINGS`): \"llama3\" divides "
      "those whose wavelength exceeds rope_original_max_len / rope_low_freq_factor by "
      "rope_scaling_factor, keeps those below rope_original_max_len / rope_high_freq_factor "
      "and blends between.")
  rope_scaling_factor: float = _field(
      8.0, "llama3 scaling: what the low frequencies are divided by.")
  rope_low_freq_factor: float = _field(1.0, "llama3 scaling: the low-frequency bound's divisor.")
  rope_high_freq_factor: float = _field(4.0, "llama3 scaling: the high-frequency bound's divisor.")
  rope_original_max_len: int = _field(
      8192, "llama3 scaling: the context length the frequencies were pretrained at.")
  rms_eps: float = _field(1e-6, "RMSNorm's epsilon.")
  qkv_bias: bool = _field(True, "biases on the q, k and v projections (Qwen2).")
  qk_norm: bool = _field(False, "per-head q/k RMSNorm (Qwen3).")
  tie_embeddings: bool = _field(False, "the LM head is the transposed embedding.")
  max_seq_len: int = _field(
      512, "the longest sequence the model serves (prompt plus completion).")
  dtype: str = _field("float32", "the compute dtype (`DTYPES`).")
  param_dtype: str = _field("float32", "the params' storage dtype (`DTYPES`).")
  remat: bool = _field(
      False, "recompute each layer's activations in the backward pass instead of storing "
      "them, except those named in `remat_saves`.")
  remat_saves: tuple[str, ...] = _field(
      (), "what remat keeps (`REMAT_SAVES`): memory traded for the FLOPs of recomputing it "
      "(`python -m benchmarks.memory --saves=...` prints both).")

  def __post_init__(self):
    object.__setattr__(self, "remat_saves", tuple(self.remat_saves))
    unknown = set(self.remat_saves) - set(REMAT_SAVES)
    if unknown:
      raise ValueError(f"model.remat_saves: unknown {sorted(unknown)}; known: "
                       f"{sorted(REMAT_SAVES)}")
    if self.remat_saves and not self.remat:
      raise ValueError(f"model.remat_saves={self.remat_saves} needs model.remat=True")
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                 "d_ff", "max_seq_len"):
      if getattr(self, name) < 1:
        fail(f"model.{name}", getattr(self, name), "must be >= 1")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(f"model.n_heads ({self.n_heads}) must be a multiple of "
                       f"model.n_kv_heads ({self.n_kv_heads})")
    if self.head_dim % 2:
      fail("model.head_dim", self.head_dim, "must be even for rotary embeddings")
    for name in ("dtype", "param_dtype"):
      _check_choice(f"model.{name}", getattr(self, name), DTYPES)
    _check_finite("model", self)
    if self.rope_theta <= 0 or self.rms_eps <= 0:
      raise ValueError("model.rope_theta and model.rms_eps must be > 0")
    _check_choice("model.rope_scaling", self.rope_scaling, ROPE_SCALINGS)
    if self.rope_scaling == "llama3":
      if self.rope_scaling_factor <= 0:
        fail("model.rope_scaling_factor", self.rope_scaling_factor, "must be > 0")
      if not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor:
        fail("model.rope_high_freq_factor", self.rope_high_freq_factor,
             f"must exceed model.rope_low_freq_factor={self.rope_low_freq_factor} > 0")
      if self.rope_original_max_len < 1:
        fail("model.rope_original_max_len", self.rope_original_max_len, "must be >= 1")

  def num_params(self) -> int:
    D, F, H, K, E, V = (self.d_model, self.d_ff, self.n_heads, self.n_kv_heads,
                        self.head_dim, self.vocab_size)
    per_layer = 2 * D * H * E + 2 * D * K * E + 3 * D * F + 2 * D
    per_layer += (H + 2 * K) * E if self.qkv_bias else 0
    per_layer += 2 * E if self.qk_norm else 0
    return self.n_layers * per_layer + V * D * (1 if self.tie_embeddings else 2) + D


_QWEN = dict(rope_theta=1e6, qkv_bias=True, max_seq_len=32768, dtype="bfloat16",
             param_dtype="bfloat16", remat=True)

MODEL_PRESETS = {
    "tiny": dict(d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, d_ff=512),
    "small": dict(d_model=512, n_layers=8, n_heads=8, n_kv_heads=4, head_dim=64, d_ff=1408),
    "qwen2.5-0.5b": dict(_QWEN, vocab_size=151936, d_model=896, n_layers=24, n_heads=14,
                         n_kv_heads=2, head_dim=64, d_ff=4864, tie_embeddings=True),
    "qwen2.5-1.5b": dict(_QWEN, vocab_size=151936, d_model=1536, n_layers=28, n_heads=12,
                         n_kv_heads=2, head_dim=128, d_ff=8960, tie_embeddings=True),
    "qwen2.5-7b": dict(_QWEN, vocab_size=152064, d_model=3584, n_layers=28, n_heads=28,
                       n_kv_heads=4, head_dim=128, d_ff=18944, tie_embeddings=False),
    # A Llama: SmolLM2-135M's shapes.
    "smollm2-135m": dict(vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3,
                         head_dim=64, d_ff=1536, rope_theta=1e5, rms_eps=1e-5, qkv_bias=False,
                         tie_embeddings=True, max_seq_len=8192),
}


def model_preset(name: str, **overrides) -> ModelConfig:
  """The named size preset, with field overrides (for example `vocab_size`)."""
  if name not in MODEL_PRESETS:
    raise ValueError(f"unknown model preset {name!r}; known: {sorted(MODEL_PRESETS)}")
  return ModelConfig(**{**MODEL_PRESETS[name], **overrides})


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """AdamW with global-norm clipping and a warmup + constant/cosine schedule."""
  learning_rate: float = _field(
      1e-4, "the peak learning rate; 0 keeps the params as they are (every update is zero), "
      "for measuring throughput at a fixed policy.")
  warmup_steps: int = _field(0, "optimizer updates of linear warmup from 0.")
  schedule: str = _field("constant", 'after warmup, "constant" or "cosine" decay (`SCHEDULES`).')
  decay_steps: int = _field(1000, "the cosine schedule's length after warmup.")
  b1: float = _field(0.9, "Adam's first-moment decay.")
  b2: float = _field(0.999, "Adam's second-moment decay.")
  eps: float = _field(1e-8, "Adam's epsilon.")
  weight_decay: float = _field(0.0, "decoupled weight decay (AdamW).")
  grad_clip: float = _field(1.0, "the global gradient norm is clipped to this.")

  def __post_init__(self):
    _check_finite("optimizer", self)
    if self.learning_rate < 0:
      fail("optimizer.learning_rate", self.learning_rate, "must be >= 0")
    if self.warmup_steps < 0:
      fail("optimizer.warmup_steps", self.warmup_steps, "must be >= 0")
    _check_choice("optimizer.schedule", self.schedule, SCHEDULES)
    if self.decay_steps < 1:
      fail("optimizer.decay_steps", self.decay_steps, "must be >= 1")
    if not (0 <= self.b1 < 1 and 0 <= self.b2 < 1):
      fail("optimizer.b1/b2", (self.b1, self.b2), "must lie in [0, 1)")
    if self.weight_decay < 0:
      fail("optimizer.weight_decay", self.weight_decay, "must be >= 0")
    if self.grad_clip <= 0:
      fail("optimizer.grad_clip", self.grad_clip, "must be > 0")


# The projections a LoRA adapter may sit on: attention's and the MLP's.
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """Low-rank adapters on a frozen base (`models.lora`): only the adapters train,
  publish and checkpoint. No dropout: see `models.lora`."""
  rank: int = _field(0, "the adapters' rank r; 0: no adapters, the whole model trains.")
  alpha: float = _field(
      32.0, "the adapters' output is scaled by alpha / rank (as PEFT's `lora_alpha`).")
  targets: tuple[str, ...] = _field(
      ("q", "k", "v", "o", "gate", "up", "down"),
      "the projections that get an adapter (`LORA_TARGETS`).")

  def __post_init__(self):
    _check_finite("lora", self)
    if self.rank < 0:
      fail("lora.rank", self.rank, "must be >= 0")
    if self.alpha <= 0:
      fail("lora.alpha", self.alpha, "must be > 0")
    if not self.targets or len(set(self.targets)) != len(self.targets):
      fail("lora.targets", self.targets, "must name at least one projection, each once")
    for target in self.targets:
      _check_choice("lora.targets", target, LORA_TARGETS)

  @property
  def enabled(self) -> bool:
    return self.rank > 0

  @property
  def scale(self) -> float:
    """What the adapters' product is multiplied by: alpha / rank."""
    return self.alpha / self.rank


@dataclasses.dataclass(frozen=True)
class PPOConfig:
  """The decoupled PPO objective (docs/architecture.md); `loss.check_hparams` validates it.

  Log-probs are taken at the sampling temperature (`generation.temperature`, or 1
  for greedy), so the trainer's recomputation matches the recorded behaviour ones.
  """
  loss: str = _field(
      "decoupled_ppo", 'the objective: a key of `loss.LOSSES`, or "module:attr" naming a loss '
      "function.")
  prox_logp: str = _field(
      "recompute", 'where π_prox comes from (`PROX_LOGP`): "recompute" (a forward pass under '
      "the params at the start of the step), \"loglinear\" (AReaL's estimate from the "
      'per-token versions, no forward pass) or "behav" (π_behav itself: naive PPO, w = 1).')
  num_minibatches: int = _field(
      1, "PPO updates per training step (AReaL's ppo_n_minibatches); π_prox is taken once, "
      "before the first, and each is the mean over its own tokens.")
  eps_clip: float = _field(0.2, "PPO clip range below 1.")
  eps_clip_higher: Optional[float] = _field(
      None, "clip range above 1 (DAPO clip-higher); None: eps_clip.")
  c_clip: Optional[float] = _field(
      None, "dual-clip constant for negative advantages; None: no dual clip.")
  importance_level: str = _field(
      "token", "\"token\" (PPO's ratio per token) or \"sequence\" (GSPO's ratio per "
      "sequence).")
  rejection_level: str = _field(
      "token", 'the behaviour-weight correction judges each "token" or each "sequence" '
      "(geometric mean of its tokens' weights).")
  rejection_action: str = _field(
      "mask", '"mask" drops what is out of bounds from the loss; "clamp" clips the weight '
      "into the bounds (truncated importance sampling).")
  rejection_metric: str = _field(
      "ratio", 'what is bounded: "ratio" (π_prox / π_behav) or a KL estimate "kl_k1", '
      '"kl_k2", "kl_k3".')
  rejection_upper: Optional[float] = _field(None, "upper bound of the metric; None: none.")
  rejection_lower: Optional[float] = _field(
      None, "lower bound of the metric; None: none. With neither bound, the weight is not "
      "corrected.")
  kl_beta: float = _field(
      0.0, "coefficient of the KL penalty to the reference policy (the params the run started "
      "from, frozen); 0: no penalty, no reference kept, no reference forward.")
  kl_estimator: str = _field(
      "k3", "the per-token estimator of the KL (`KL_ESTIMATORS`), with d = log π - log π_ref: "
      '"k1" d, "k2" d² / 2, "k3" exp(-d) - 1 + d.')
  kl_in: str = _field(
      "loss", 'where the penalty goes (`KL_PLACEMENTS`): "loss" adds kl_beta times the token '
      'mean of the estimate under π_θ to the loss (it has a gradient); "reward" subtracts '
      "kl_beta times the sum of the estimate under π_behav over each sample's tokens from its "
      "reward, before the advantages are normalised (no gradient).")
  entropy_coef: float = _field(
      0.0, "coefficient of the entropy bonus: the loss less entropy_coef times the token mean "
      "of the policy's entropy; 0: none.")

  def __post_init__(self):
    _check_finite("ppo", self)


@dataclasses.dataclass(frozen=True)
class AdvantageConfig:
  """Reward shaping, DAPO overlong penalty and group/batch normalisation; checked by
  `advantages.from_config`, which names its keywords after these fields.
  """
  reward_bias: float = _field(0.0, "added to every reward before scaling.")
  reward_scale: float = _field(1.0, "multiplies every reward (after the bias).")
  reward_clip: Optional[float] = _field(
      None, "the shaped reward is clipped to [-c, c]; None: no clip.")
  overlong_cache_len: Optional[int] = _field(
      None, "DAPO's soft overlong penalty starts this many tokens before "
      "`generation.max_new_tokens`; None: no penalty.")
  overlong_factor: float = _field(1.0, "the penalty at the length limit.")
  zero_truncated: bool = _field(False, "a sample cut off at the length limit scores 0.")
  mean_level: Optional[str] = _field(
      "group", "the baseline subtracted: the \"group\"'s or the \"batch\"'s mean, or None.")
  std_level: Optional[str] = _field(
      "group", "the std divided by: the \"group\"'s, the \"batch\"'s, or None (Dr.GRPO).")
  leave_one_out: bool = _field(False, "the group mean leaves the sample itself out (RLOO).")

  def __post_init__(self):
    _check_finite("advantage", self)


@dataclasses.dataclass(frozen=True)
class BatchingConfig:
  """Token-budget micro-batching (first-fit decreasing into packed rows)."""
  max_tokens_per_mb: int = _field(1024, "the token budget of one micro-batch per batch shard.")
  row_buckets: tuple[int, ...] = _field(
      (), "the packed row lengths allowed; empty: `default_row_buckets`.")
  reuse_slack: float = _field(
      0.1, "a batch packs into a shape the train step already compiled when that costs at "
      "most this share more than its cheapest shape (`batching.pack_dynamic`'s estimate); 0 "
      "compiles every cheapest shape.")

  def __post_init__(self):
    if self.max_tokens_per_mb < 1:
      fail("batching.max_tokens_per_mb", self.max_tokens_per_mb, "must be >= 1")
    if any(b < 1 or b > self.max_tokens_per_mb for b in self.row_buckets):
      fail("batching.row_buckets", self.row_buckets,
           "must lie in [1, batching.max_tokens_per_mb]")
    if not self.reuse_slack >= 0:
      fail("batching.reuse_slack", self.reuse_slack, "must be >= 0")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """The trainer's device mesh; one axis may be -1 to take the remaining devices."""
  data: int = _field(1, "pure data parallelism (params replicated).")
  fsdp: int = _field(-1, "data parallelism with params and optimizer state sharded.")
  tensor: int = _field(1, "heads, MLP width and vocabulary split across devices.")

  def __post_init__(self):
    sizes = dataclasses.asdict(self)
    if sum(v == -1 for v in sizes.values()) > 1:
      fail("mesh", sizes, "may have at most one axis of -1")
    for name, v in sizes.items():
      if v == 0 or v < -1:
        fail(f"mesh.{name}", v, "must be >= 1 or -1")

  def axis_sizes(self, num_devices: int) -> dict[str, int]:
    """Resolves -1 and checks that the axes multiply to `num_devices`."""
    sizes = dataclasses.asdict(self)
    known = 1
    for v in sizes.values():
      known *= v if v > 0 else 1
    for name, v in sizes.items():
      if v == -1:
        if num_devices % known:
          fail(f"mesh.{name}", v, f"cannot fill {num_devices} devices with the other "
               f"axes' product {known}")
        sizes[name] = num_devices // known
    product = sizes["data"] * sizes["fsdp"] * sizes["tensor"]
    if product != num_devices:
      fail("mesh (data*fsdp*tensor)", sizes, f"must multiply to the {num_devices} devices")
    return sizes


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """The training loop."""
  max_consecutive_skips: int = _field(
      5, "non-finite steps in a row after which the run stops with an error (each skipped "
      "step leaves the params as they were).")

  def __post_init__(self):
    if self.max_consecutive_skips < 1:
      fail("train.max_consecutive_skips", self.max_consecutive_skips, "must be >= 1")


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
  """Sampling and generator-pool settings."""
  max_prompt_len: int = _field(64, "the longest prompt (tokens) a rollout takes.")
  max_new_tokens: int = _field(128, "the most tokens a sample generates after its prompt.")
  group_size: int = _field(8, "samples per prompt (G).")
  temperature: float = _field(1.0, "the sampling temperature (> 0 for training).")
  top_k: int = _field(0, "sample from the k most likely tokens; 0: all.")
  top_p: float = _field(
      1.0, "sample from the smallest set of tokens whose mass reaches top_p; 1: all.")
  truncated_logp: bool = _field(
      True, "record and train log-probs under the top-k / top-p truncated distribution tokens "
      "are drawn from; False: under the full softmax (comparison).")
  num_slots: int = _field(32, "samples decoded at once per generator engine (S).")
  update_mode: str = _field(
      "retract", 'how new weights reach in-flight samples (`UPDATE_MODES`): "retract" '
      're-prefills them, "keep" keeps their KV cache, "drain" lets them finish first.')
  steps_per_call: int = _field(
      8, "decode steps per host round trip; new samples, aborts and weight updates apply "
      "between two such chunks.")
  kv_blocks: int = _field(
      0, "KV cache blocks of each generator engine, shared by the samples in flight (one that "
      "finds none free is preempted and resumed later); 0: enough for every slot at "
      "`max_length`; otherwise at least one sequence of `max_length`.")
  kv_block_size: int = _field(16, "tokens per KV block.")

  def __post_init__(self):
    for name in ("max_prompt_len", "max_new_tokens", "group_size", "num_slots",
                 "steps_per_call", "kv_block_size"):
      if getattr(self, name) < 1:
        fail(f"generation.{name}", getattr(self, name), "must be >= 1")
    if self.kv_blocks and self.kv_blocks < self.sequence_blocks:
      fail("generation.kv_blocks", self.kv_blocks,
           f"must be 0 (every slot at full length) or hold one sequence of max_length: "
           f"at least {self.sequence_blocks} blocks of generation.kv_block_size="
           f"{self.kv_block_size} for {self.max_length} tokens")
    _check_finite("generation", self)
    if self.temperature < 0:
      fail("generation.temperature", self.temperature, "must be >= 0")
    if self.top_k < 0:
      fail("generation.top_k", self.top_k, "must be >= 0 (0 disables top-k)")
    if not 0 < self.top_p <= 1:
      fail("generation.top_p", self.top_p, "must lie in (0, 1]")
    _check_choice("generation.update_mode", self.update_mode, UPDATE_MODES)

  @property
  def logp_temperature(self) -> float:
    """The temperature of the recorded log-probs (greedy records them at 1)."""
    return self.temperature or 1.0

  @property
  def max_length(self) -> int:
    """The longest sequence: prompt plus completion."""
    return self.max_prompt_len + self.max_new_tokens

  @property
  def sequence_blocks(self) -> int:
    """KV blocks of one sequence of `max_length`."""
    return -(-self.max_length // self.kv_block_size)

  @property
  def kv_cache_blocks(self) -> int:
    """KV blocks of one generator engine: `kv_blocks`, or every slot at full length."""
    return self.kv_blocks or self.num_slots * self.sequence_blocks


@dataclasses.dataclass(frozen=True)
class StalenessConfig:
  """The staleness bound η and admission; groups are counted in prompts."""
  max_staleness: Optional[int] = _field(
      4, "η, how many versions a trained token may lag the trainer; None: unbounded.")
  on_stale: str = _field(
      "drop", 'what happens to a group holding a token older than v - η (`ON_STALE`): "drop" '
      'it, "mask_tokens" (train it without those tokens) or "admit" it as it is.')
  max_concurrent: int = _field(64, "prompt groups generating at once, at most.")

  def __post_init__(self):
    if self.max_staleness is not None and self.max_staleness < 0:
      fail("staleness.max_staleness", self.max_staleness, "must be >= 0 or None")
    if self.max_concurrent < 1:
      fail("staleness.max_concurrent", self.max_concurrent, "must be >= 1")
    _check_choice("staleness.on_stale", self.on_stale, ON_STALE)


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  """Rewards and group handling."""
  reward_fn: Optional[str] = _field(
      None, "replaces the task's own reward function (None: the task's): a name from "
      '`rewards.REWARD_FNS` or "module:function", or several separated by commas, whose '
      "rewards are summed with `reward_weights`.")
  reward_style: str = _field(
      "auto", 'how each function is called (`REWARD_STYLES`, `rewards.adapters`): "single" '
      "`fn(completion, reference) -> float`; \"trl\" TRL's batched `fn(completions, "
      "**columns) -> list[float]`; \"verl\" verl's `compute_score(data_source, solution_str, "
      'ground_truth, extra_info)`; "auto" decides per function by its parameter names.')
  reward_weights: tuple[float, ...] = _field(
      (), "one weight per function of `reward_fn`; empty: all 1.")
  reward_timeout_s: float = _field(10.0, "hard limit on one reward call (all its functions).")
  reward_workers: int = _field(1, "reward worker processes.")
  reward_memory_mb: int = _field(
      8192, "address-space limit of each reward worker process (0: none).")
  max_reward_error_rate: float = _field(
      0.5, "the run stops, naming the reward function and its first error, once more than "
      "this share of its last `reward_error_window` calls failed (raised, timed out, crashed, "
      "returned a non-number); 1: never.")
  reward_error_window: int = _field(64, "the recent reward calls that rate is taken over.")
  dynamic_filter: bool = _field(
      False, "drop groups whose rewards are all equal (no learning signal).")
  allow_weak_sandbox: bool = _field(
      False, "lets code rewards run without bubblewrap (rewards/sandbox.py).")

  def __post_init__(self):
    _check_finite("rollout", self)
    object.__setattr__(self, "reward_weights", tuple(self.reward_weights))
    if self.reward_timeout_s <= 0:
      fail("rollout.reward_timeout_s", self.reward_timeout_s, "must be > 0")
    if self.reward_workers < 1:
      fail("rollout.reward_workers", self.reward_workers, "must be >= 1")
    _check_choice("rollout.reward_style", self.reward_style, REWARD_STYLES)
    if self.reward_fn is not None and not all(n.strip() for n in self.reward_fn.split(",")):
      fail("rollout.reward_fn", self.reward_fn, "must be names separated by commas")
    if not all(math.isfinite(w) for w in self.reward_weights):
      fail("rollout.reward_weights", self.reward_weights, "must be finite")
    if self.reward_weights:
      names = [] if self.reward_fn is None else self.reward_fn.split(",")
      if len(names) != len(self.reward_weights):
        fail("rollout.reward_weights", self.reward_weights,
             f"must give one weight per function of rollout.reward_fn ({len(names)})")
    if not 0 <= self.max_reward_error_rate <= 1:
      fail("rollout.max_reward_error_rate", self.max_reward_error_rate, "must be in [0, 1]")
    if self.reward_error_window < 1:
      fail("rollout.reward_error_window", self.reward_error_window, "must be >= 1")
    if self.reward_memory_mb < 0:
      fail("rollout.reward_memory_mb", self.reward_memory_mb, "must be >= 0 (0: no limit)")


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """Deadlines on the run's blocking waits, and rollout-worker restarts.

  A wait longer than `warn_after_s` is logged, naming what is awaited (again at
  each doubling); one longer than `stall_timeout_s` checkpoints and stops the run
  with an error naming the stalled component. A rollout worker whose process dies
  (Ray placement) is restarted up to `max_worker_restarts` times in all.

  A run resumed from its workdir keeps its config: a change outside `RESUMABLE_FIELDS`
  (the length of the run, deadlines, checkpoints, evaluation, placement) stops it
  with the differing fields named, unless `allow_config_change`.
  """
  warn_after_s: float = _field(
      60.0, "a blocking wait longer than this is logged, naming what it awaits.")
  stall_timeout_s: float = _field(
      600.0, "a wait longer than this checkpoints and stops the run.")
  max_worker_restarts: int = _field(
      10, "rollout-worker restarts allowed over the whole run (Ray).")
  allow_config_change: bool = _field(
      False, "resume even if the config differs outside `RESUMABLE_FIELDS`.")
  max_untrainable_groups: int = _field(
      256, "the run stops, saying why, once this many groups in a row finished without one "
      "that can be trained (rejected as too long, failed, filtered or stale); 0: never.")
  record_schedule: bool = _field(
      True, "record every training batch as trained in the workdir's `schedule/`, so that "
      "`--replay` can re-execute the run (`rl.replay`).")
  prune_schedule: bool = _field(
      True, "delete the recorded batches of the steps up to the oldest checkpoint "
      "retention kept (a replay starts from it), so the record is as bounded as the "
      "checkpoints; False: keep every batch from the first.")

  def __post_init__(self):
    _check_finite("run", self)
    if self.warn_after_s <= 0:
      fail("run.warn_after_s", self.warn_after_s, "must be > 0")
    if self.stall_timeout_s <= self.warn_after_s:
      fail("run.stall_timeout_s", self.stall_timeout_s,
           f"must exceed run.warn_after_s={self.warn_after_s}")
    if self.max_worker_restarts < 0:
      fail("run.max_worker_restarts", self.max_worker_restarts, "must be >= 0")
    if self.max_untrainable_groups < 0:
      fail("run.max_untrainable_groups", self.max_untrainable_groups, "must be >= 0")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  """Checkpoints of the train state and the run's bookkeeping."""
  every_steps: int = _field(
      10, "checkpoint every this many training steps (and at the end and on a stop signal).")
  keep: int = _field(3, "the newest checkpoints kept.")

  def __post_init__(self):
    if self.every_steps < 1:
      fail("checkpoint.every_steps", self.every_steps, "must be >= 1")
    if self.keep < 1:
      fail("checkpoint.keep", self.keep, "must be >= 1")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  """Held-out evaluation: greedy accuracy, and pass@k with `pass_k` samples at T=1.

  So that a reward on another scale, or one shaped with partial credit, still gives a
  meaningful accuracy, correctness has a criterion of its own.
  """
  every_steps: int = _field(
      0, "evaluate every this many training steps; 0: only before and after.")
  num_prompts: int = _field(
      200, "held-out prompts per evaluation (fewer if the task has fewer).")
  pass_k: int = _field(
      4, "samples per prompt for pass@k; 0: none (greedy accuracy alone, half the work).")
  correct_threshold: float = _field(
      1.0, "a completion is correct when its score is at least this.")
  correct_fn: Optional[str] = _field(
      None, "what scores correctness (a reward function's name, called as "
      "`rollout.reward_fn`'s are); None: the training reward.")
  also_correct_fns: dict[str, str] = _field(
      {}, "more criteria of correctness, by name: each greedy completion is also scored by "
      "these functions (named and called as `correct_fn` is), and the share scoring at least "
      "`correct_threshold` is reported as `accuracy_NAME` (a lenient score beside a strict "
      "one, say).")

  def __post_init__(self):
    _check_finite("eval", self)
    if self.every_steps < 0:
      fail("eval.every_steps", self.every_steps, "must be >= 0")
    if self.num_prompts < 1:
      fail("eval.num_prompts", self.num_prompts, "must be >= 1")
    if self.pass_k < 0:
      fail("eval.pass_k", self.pass_k, "must be >= 0")
    for name, fn in self.also_correct_fns.items():
      if not re.fullmatch(r"[A-Za-z_]\w*", str(name)) or not isinstance(fn, str) or not fn:
        fail("eval.also_correct_fns", self.also_correct_fns,
             "must map names (letters, digits, _) to reward function names")


@dataclasses.dataclass(frozen=True)
class LogConfig:
  """What a run logs besides its metrics: sample completions, and Weights & Biases."""
  samples_every: int = _field(
      10, "every this many training steps, the first `num_samples` completions of the batch "
      "just trained, with their prompts and rewards, go to `WORKDIR/samples.jsonl` and "
      "TensorBoard's text tab; 0: never.")
  num_samples: int = _field(
      4, "completions per such entry (a group's together, in batch order).")
  sample_chars: int = _field(
      2000, "a prompt or completion longer than this many characters keeps its beginning and "
      "its end, the middle cut out.")
  wandb_project: Optional[str] = _field(
      None, "a Weights & Biases project to log the metrics to as well (needs the `wandb` "
      "package); None: none.")

  def __post_init__(self):
    if self.samples_every < 0:
      fail("log.samples_every", self.samples_every, "must be >= 0 (0: never)")
    if self.num_samples < 1:
      fail("log.num_samples", self.num_samples, "must be >= 1")
    if self.sample_chars < 64:
      fail("log.sample_chars", self.sample_chars, "must be >= 64")
    if self.wandb_project == "":
      fail("log.wandb_project", self.wandb_project, "must be a project name or None")


@dataclasses.dataclass(frozen=True)
class SFTConfig:
  """Supervised warm start on the task's reference solutions before RL."""
  steps: int = _field(0, "warm-start steps; 0: none.")
  batch_size: int = _field(64, "examples per warm-start step.")
  learning_rate: float = _field(1e-3, "the warm start's learning rate.")
  log_every: int = _field(
      50, "a line, and a `metrics.jsonl` entry (the mean loss since the last one, the "
      "learning rate), every this many steps.")

  def __post_init__(self):
    _check_finite("sft", self)
    if self.steps < 0:
      fail("sft.steps", self.steps, "must be >= 0")
    if self.batch_size < 1:
      fail("sft.batch_size", self.batch_size, "must be >= 1")
    if self.learning_rate <= 0:
      fail("sft.learning_rate", self.learning_rate, "must be > 0")
    if self.log_every < 1:
      fail("sft.log_every", self.log_every, "must be >= 1")


@dataclasses.dataclass(frozen=True)
class ArithmeticConfig:
  """The arithmetic task distribution and its train / held-out split (`tasks.arithmetic`)."""
  min_terms: int = _field(2, "fewest operands in a problem (>= 2: at least one step).")
  max_terms: int = _field(8, "most operands in a problem.")
  tail_exponent: float = _field(
      1.5, "P(steps = s) ∝ s^-tail_exponent; smaller is a heavier tail.")
  max_operand: int = _field(9, "operands are drawn uniformly from [0, max_operand].")
  max_value: int = _field(
      99, "running values stay in [0, max_value]; must be >= 2 * max_operand so that one of "
      "`+`, `-` always keeps the value in range.")
  heldout_fraction: float = _field(
      0.1, "share of all prompt strings reserved for the held-out split.")
  seed: int = _field(0, "seeds the training stream (the held-out set does not depend on it).")

  def __post_init__(self):
    name = "task.arithmetic."
    _check_finite(name[:-1], self)
    if self.min_terms < 2:
      fail(name + "min_terms", self.min_terms, "must be >= 2")
    if self.max_terms < self.min_terms:
      fail(name + "max_terms", self.max_terms, f"must be >= {name}min_terms ({self.min_terms})")
    if self.tail_exponent < 0:
      fail(name + "tail_exponent", self.tail_exponent, "must be >= 0")
    if self.max_operand < 1:
      fail(name + "max_operand", self.max_operand, "must be >= 1")
    if self.max_value < 2 * self.max_operand:
      fail(name + "max_value", self.max_value,
           f"must be >= 2 * {name}max_operand ({2 * self.max_operand})")
    if not 0 < self.heldout_fraction < 1:
      fail(name + "heldout_fraction", self.heldout_fraction, "must lie in (0, 1)")
    if self.seed < 0:
      fail(name + "seed", self.seed, "must be >= 0")


# The answer formats of the chat arithmetic task: `<answer>N</answer>` or `\boxed{N}`.
ANSWER_FORMATS = ("answer", "boxed")


@dataclasses.dataclass(frozen=True)
class ChatArithmeticConfig:
  """Arithmetic asked through a model's chat template (`task.name="arithmetic_chat"`,
  `tasks.chat_arithmetic`)."""
  ops: str = _field("+-*", "the operators, each drawn as often.")
  min_operand: int = _field(0, "operands are drawn uniformly from [min_operand, max_operand].")
  max_operand: int = _field(99, "the largest operand.")
  answer_format: str = _field(
      "answer", 'how the answer must be written (`ANSWER_FORMATS`): "answer" '
      '(`<answer>N</answer>`) or "boxed" (`\\boxed{N}`).')
  system: str = _field(
      "Reply with only the result, written as {format}.",
      "the system turn, `{format}` replaced by the answer format (`<answer>N</answer>`); "
      "\"\" leaves it out (the chat template may then write its own).")
  question: str = _field(
      "What is {a} {op} {b}?", "the user's text, `{a}`, `{op}` and `{b}` filled in.")
  examples: tuple[str, ...] = _field(
      (), "worked examples, each `a op b`, asked and answered in the answer format as "
      "earlier turns of the conversation, before the question.")
  heldout_fraction: float = _field(
      0.1, "share of all questions reserved for the held-out split.")
  seed: int = _field(0, "seeds the training stream (the held-out set does not depend on it).")

  def __post_init__(self):
    name = "task.arithmetic_chat."
    object.__setattr__(self, "examples", tuple(self.examples))
    _check_finite(name[:-1], self)
    if not self.ops or set(self.ops) - set("+-*") or len(set(self.ops)) < len(self.ops):
      fail(name + "ops", self.ops, "must be distinct operators of '+-*'")
    if self.min_operand < 0:
      fail(name + "min_operand", self.min_operand, "must be >= 0")
    if self.max_operand < self.min_operand:
      fail(name + "max_operand", self.max_operand,
           f"must be >= {name}min_operand ({self.min_operand})")
    _check_choice(name + "answer_format", self.answer_format, ANSWER_FORMATS)
    for key in ("{a}", "{op}", "{b}"):
      if key not in self.question:
        fail(name + "question", self.question, f"must contain {key!r}")
    for example in self.examples:
      if not re.fullmatch(r"\d+ [-+*] \d+", example):
        fail(name + "examples", example, "must each be `a op b` (for example '3 + 5')")
    if not 0 < self.heldout_fraction < 1:
      fail(name + "heldout_fraction", self.heldout_fraction, "must lie in (0, 1)")
    if self.seed < 0:
      fail(name + "seed", self.seed, "must be >= 0")


DEFAULT_MATH_SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."


@dataclasses.dataclass(frozen=True)
class MathConfig:
  """The math task (`task.name="math"`): its JSONL files and how a prompt is written.

  The builder checks that the paths are files and makes them absolute (Ray actors may
  run elsewhere).
  """
  train_path: Optional[str] = _field(
      None, "JSONL file of training problems (see `tasks.math_data.load_jsonl`).")
  heldout_path: Optional[str] = _field(
      None, "JSONL file of held-out problems; None holds out a hashed `heldout_fraction` of "
      "the training file's questions instead.")
  heldout_fraction: float = _field(
      0.1, "the held-out share of the training file without `heldout_path`.")
  template: str = _field("{question}", "the user text, `{question}` replaced by the question.")
  chat: bool = _field(
      True, "wrap the text in the model's chat template; false for a base model, which then "
      "sees the template's text alone.")
  system: str = _field(DEFAULT_MATH_SYSTEM, "the chat's system turn; \"\" leaves it out.")
  seed: int = _field(0, "seeds the training order (rollout worker i uses seed + 1000 i).")

  def __post_init__(self):
    _check_finite("task.math", self)
    if not 0 < self.heldout_fraction < 1:
      fail("task.math.heldout_fraction", self.heldout_fraction, "must lie in (0, 1)")
    if "{question}" not in self.template:
      fail("task.math.template", self.template, "must contain '{question}'")
    if self.seed < 0:
      fail("task.math.seed", self.seed, "must be >= 0")


@dataclasses.dataclass(frozen=True)
class CodeConfig:
  """The code task's problems: programs that read n and print an expression of it."""
  min_ops: int = _field(1, "fewest operations in an expression.")
  max_ops: int = _field(2, "most operations in an expression.")
  num_tests: int = _field(3, "test cases per problem.")
  heldout_fraction: float = _field(0.1, "the hashed share of the prompts held out.")
  seed: int = _field(0, "seeds the training stream.")

  def __post_init__(self):
    _check_finite("task.code", self)
    if self.min_ops < 1:
      fail("task.code.min_ops", self.min_ops, "must be >= 1")
    if self.max_ops < self.min_ops:
      fail("task.code.max_ops", self.max_ops, f"must be >= task.code.min_ops ({self.min_ops})")
    if self.num_tests < 1:
      fail("task.code.num_tests", self.num_tests, "must be >= 1")
    if not 0 < self.heldout_fraction < 1:
      fail("task.code.heldout_fraction", self.heldout_fraction, "must lie in (0, 1)")
    if self.seed < 0:
      fail("task.code.seed", self.seed, "must be >= 0")


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """The data task (`task.name="data"`, `tasks.data_task`): prompts, and what they are
  checked against, from JSONL or Parquet files in the formats TRL and verl read.

  The builder checks that the paths are files and makes them absolute.
  """
  train_path: Optional[str] = _field(
      None, "the training rows: a `.jsonl` (or `.json`, one object per line) or `.parquet` "
      "file.")
  heldout_path: Optional[str] = _field(
      None, "the held-out rows, same formats; None holds out a hashed `heldout_fraction` of "
      "the training file's prompts instead.")
  heldout_fraction: float = _field(
      0.1, "the held-out share of the training file without `heldout_path`.")
  prompt_key: str = _field(
      "prompt", 'the prompt column: a string, or a conversation (a list of {"role", '
      "\"content\"} messages) that the tokenizer's chat template renders.")
  answer_key: Optional[str] = _field(
      None, "the reference column: what `fn(completion, reference)` receives (None: the row's "
      "columns other than the prompt, as a dict) and, without `completion_key`, the warm "
      "start's target.")
  completion_key: Optional[str] = _field(
      None, "the warm start's target column (TRL's \"completion\"); None: `answer_key`. A "
      "warm start (`sft.steps > 0`) needs one of the two.")
  tokenizer: str = _field(
      "hf", '"hf" (the tokenizer of `task.tokenizer_dir`, default `hf_model_dir`) or "bytes" '
      "(UTF-8 bytes, `tasks.tokenizer.ByteTokenizer`, 259 ids).")
  chat_template_kwargs: dict[str, Any] = _field(
      {}, 'extra variables of the chat template (for example {"enable_thinking": False} for '
      "Qwen3), as plain data.")
  seed: int = _field(0, "seeds the training order (rollout worker i uses seed + 1000 i).")

  def __post_init__(self):
    _check_finite("task.data", self)
    if not 0 < self.heldout_fraction < 1:
      fail("task.data.heldout_fraction", self.heldout_fraction, "must lie in (0, 1)")
    for name in ("prompt_key", "answer_key", "completion_key"):
      if getattr(self, name) == "":
        fail(f"task.data.{name}", "", "must name a column")
    if self.prompt_key in (self.answer_key, self.completion_key):
      fail("task.data.prompt_key", self.prompt_key,
           "must differ from task.data.answer_key and task.data.completion_key")
    _check_choice("task.data.tokenizer", self.tokenizer, DATA_TOKENIZERS)
    try:
      json.dumps(self.chat_template_kwargs, allow_nan=False)
    except (TypeError, ValueError) as e:
      fail("task.data.chat_template_kwargs", self.chat_template_kwargs,
           f"must hold plain data ({e})")
    if self.seed < 0:
      fail("task.data.seed", self.seed, "must be >= 0")


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


@dataclasses.dataclass(frozen=True)
class AgentConfig:
  """An agent written for the OpenAI client, trained through the run's OpenAI-compatible
  endpoint (`task.name="agent"`, `agents`)."""
  episode: str = _field(
      "", '"module:function" naming `async def episode(client, row) -> float`: one episode '
      "of the agent, given an `openai.AsyncOpenAI` client pointed at the episode's endpoint "
      "and the task row; its return value is the episode's reward.")
  task: str = _field(
      "arithmetic", "the task the agent works on (a `task.name` other than \"agent\"): its "
      "prompts, rows (what `reference` gives), held-out set, tokenizer and, for held-out "
      "accuracy, reward function.")
  host: str = _field(
      "127.0.0.1", "the address the endpoint binds; any but a loopback one needs `api_key`.")
  port: int = _field(0, "the endpoint's port; 0: a free one.")
  api_key: Optional[str] = _field(
      None, "the bearer token every request must carry; None: none (loopback only).")
  deadline_s: float = _field(
      120.0, "an episode still running after this many seconds is cancelled and lost.")
  max_tokens: Optional[int] = _field(
      None, "an episode's budget of tokens after its first prompt (generated and sent back "
      "together); None: `generation.max_new_tokens`. A request past it loses the episode.")
  add_bos: bool = _field(
      False, "put the tokenizer's BOS before a completion request's text prompt, as the task "
      "encodes its prompts (the synthetic tasks' prompts begin with BOS; chat templates "
      "write their own).")

  def __post_init__(self):
    if self.host not in LOOPBACK_HOSTS and not self.api_key:
      fail("task.agent.api_key", self.api_key,
           f"must be set when task.agent.host={self.host!r} is not a loopback address")
    if not 0 <= self.port < 65536:
      fail("task.agent.port", self.port, "must be in [0, 65536)")
    if not self.deadline_s > 0:
      fail("task.agent.deadline_s", self.deadline_s, "must be > 0")
    if self.max_tokens is not None and self.max_tokens < 1:
      fail("task.agent.max_tokens", self.max_tokens, "must be >= 1 or None")
    if self.task == "agent":
      fail("task.agent.task", self.task, "must name the task the agent works on, not itself")


@dataclasses.dataclass(frozen=True)
class TaskConfig:
  """What the run learns: a built-in task by name, or a user's."""
  name: str = _field(
      "arithmetic", 'a key of `tasks.registry.TASKS` — "arithmetic" (`arithmetic`, the '
      'character tokenizer), "arithmetic_tool" (the same problems with a calculator tool over '
      'several turns), "arithmetic_chat" (`arithmetic_chat`, questions through a pretrained '
      "model's chat template, the answer in a strict format), \"code\" (`code`, small "
      'programs run in the sandbox), "math" (`math`, '
      "GSM8K/MATH JSONL files, the tokenizer of `hf_model_dir`), \"data\" (`data`, a user's "
      "own JSONL or Parquet rows), \"agent\" (`agent`, an agent written for the OpenAI client, "
      "on the task `agent.task`) — or \"module:attr\" naming a user's task factory, called "
      "with this section.")
  options: dict[str, Any] = _field(
      {}, "a user task's own options (plain data: strings, numbers, bools, None, lists and "
      "mappings, as config.json holds them); the factory checks them.")
  arithmetic: ArithmeticConfig = ArithmeticConfig()
  arithmetic_chat: ChatArithmeticConfig = ChatArithmeticConfig()
  math: MathConfig = MathConfig()
  code: CodeConfig = CodeConfig()
  data: DataConfig = DataConfig()
  agent: AgentConfig = AgentConfig()
  tokenizer_dir: Optional[str] = _field(
      None, "a Hugging Face directory with tokenizer files, for tasks that use one; None: "
      "`hf_model_dir` (the builder fills it in).")
  max_prompt_len: Optional[int] = _field(
      None, "a task drops prompts longer than this (and says how many); None: "
      "`generation.max_prompt_len` (the builder fills it in).")
  max_turns: Optional[int] = _field(
      None, "the most policy turns of a multi-turn episode; None: the task's own (for "
      '"arithmetic_tool", `arithmetic.max_terms`: one call per step and the answer).')
  sample_per_turn: bool = _field(
      False, "train each policy turn of an episode as a sample of its own, the episode before "
      "it as its prompt (`trajectory.split_turns`), instead of the whole episode as one "
      "sample. Advantages stay the episode's.")

  def __post_init__(self):
    try:
      json.dumps(self.options, allow_nan=False)
    except (TypeError, ValueError) as e:
      fail("task.options", self.options, f"must hold plain data ({e})")
    if self.max_turns is not None and self.max_turns < 1:
      fail("task.max_turns", self.max_turns, "must be >= 1 or None")


# The help of the trainer's and the rollout workers' field of each pair.
_GPUS = ("GPUs Ray gives the trainer and each rollout worker (a fraction shares one GPU; set "
         "`gpu_memory_fraction` then).")
_CPUS = "CPUs Ray reserves for the trainer and each rollout worker."
_CORES = ("Linux cores to pin the trainer's (each rollout worker's) threads to, e.g. to give "
          "them disjoint cores of one host; empty: none.")


@dataclasses.dataclass(frozen=True)
class PlacementConfig:
  """Where a run's parts run (`rl.build`): which devices, which processes."""
  kind: str = _field(
      "in_process", 'one of `PLACEMENTS`: "in_process" (one Python process, the parts on '
      'threads) or "ray" (the parameter server, the trainer and each rollout worker a Ray '
      "actor).")
  trainer_devices: int = _field(
      -1, "how many of this host's devices, the first ones, the trainer's mesh takes (`mesh` "
      "splits them); -1: all of them, and the generator engines share the first. Across "
      "`jax.distributed` processes the trainer takes every device.")
  generator_replicas: int = _field(
      -1, "generator engines on the devices the trainer leaves (data-parallel generation, one "
      "rollout controller spreading groups over them), each on `devices_per_replica` devices; "
      "-1: as many as fit, or 1 on the trainer's first devices when it leaves none.")
  devices_per_replica: int = _field(
      1, "the devices of one generator engine (tensor-parallel generation: params split over "
      "heads and MLP width, the `tensor` axis).")
  rollout_workers: int = _field(
      1, "rollout workers (Ray actors), each with its own prompt stream, generator engines "
      "and reward workers.")
  ray_address: Optional[str] = _field(
      None, 'an existing Ray cluster ("auto" on a node of one); None starts a local instance.')
  trainer_gpus: float = _field(0.0, _GPUS)
  rollout_gpus: float = _field(0.0, _GPUS)
  trainer_cpus: float = _field(0.0, _CPUS)
  rollout_cpus: float = _field(0.0, _CPUS)
  gpu_memory_fraction: float = _field(
      0.0, "XLA_PYTHON_CLIENT_MEM_FRACTION of every actor (0: JAX's default, which "
      "preallocates most of a GPU).")
  working_dir: Optional[str] = _field(
      None, "Ray `runtime_env` working_dir: this directory is shipped to every node and is "
      "the actors' working directory (user task and reward modules in it import there). None: "
      "local actors get this process's sys.path.")
  py_modules: tuple[str, ...] = _field(
      (), "Ray `runtime_env` py_modules: more module directories or files to ship.")
  pin_trainer_cores: tuple[int, ...] = _field((), _CORES)
  pin_rollout_cores: tuple[int, ...] = _field((), _CORES)
  publish_dtype: Optional[str] = _field(
      None, "the dtype (\"bfloat16\", \"float16\") of the params' host copies when they cross "
      "processes (Ray, `jax.distributed`); None: the params' own. 16 bits halve a float32 "
      "model's transfer; the generators then sample with the rounded weights (their log-probs "
      "are what the decoupled objective corrects for).")

  def __post_init__(self):
    _check_choice("placement.kind", self.kind, PLACEMENTS)
    if self.publish_dtype is not None:
      _check_choice("placement.publish_dtype", self.publish_dtype, DTYPES[1:])
    _check_finite("placement", self)
    for name in ("trainer_devices", "generator_replicas"):
      value = getattr(self, name)
      if value == 0 or value < -1:
        fail(f"placement.{name}", value, "must be >= 1 or -1 (automatic)")
    for name in ("devices_per_replica", "rollout_workers"):
      if getattr(self, name) < 1:
        fail(f"placement.{name}", getattr(self, name), "must be >= 1")
    for name in ("trainer_gpus", "rollout_gpus", "trainer_cpus", "rollout_cpus"):
      if getattr(self, name) < 0:
        fail(f"placement.{name}", getattr(self, name), "must be >= 0")
    if not 0 <= self.gpu_memory_fraction < 1:
      fail("placement.gpu_memory_fraction", self.gpu_memory_fraction,
           "must lie in [0, 1) (0: JAX's default)")
    if self.rollout_workers > 1 and self.kind != "ray":
      fail("placement.rollout_workers", self.rollout_workers,
           "must be 1 unless placement.kind='ray' (in one process, use generator_replicas)")


@dataclasses.dataclass(frozen=True)
class CPUConfig:
  """XLA:CPU only (`async_rl.cpu`): programs dispatched from several threads run at
  once, one per core, where one program's small ops mostly use one core. Ignored on
  accelerators.
  """
  decode_threads: int = _field(
      0, "slot groups of a generator engine, each decoded from its own thread; 0: half the "
      "cores (the generator and the trainer share them).")
  grad_threads: int = _field(
      0, "threads that share each update's micro-batches; 0: half the cores.")

  def __post_init__(self):
    for name in ("decode_threads", "grad_threads"):
      if getattr(self, name) < 0:
        fail(f"cpu.{name}", getattr(self, name), "must be >= 0 (0: automatic)")


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
  """Everything one run needs."""
  seed: int = _field(0, "seeds the params' init, the sampling and the task's streams.")
  batch_groups: int = _field(8, "prompt groups per training batch (B).")
  num_steps: int = _field(100, "training steps to run to (a resumed run continues to it).")
  hf_model_dir: Optional[str] = _field(
      None, "the pretrained model a fresh run starts from: a local Hugging Face "
      "Qwen2/Qwen3/Llama directory, a GGUF file (PATH.gguf, converted once into a directory "
      "in the model cache) or a shipped model's name (`models.pretrained.SHIPPED`, fetched "
      "and converted on first use). The builder reads the architecture fields of `model` from "
      "its config.json, and only `HF_RUN_MODEL_FIELDS` stay as configured. None: random "
      "weights (or the warm start).")
  model: ModelConfig = ModelConfig()
  optimizer: OptimizerConfig = OptimizerConfig()
  lora: LoraConfig = LoraConfig()
  ppo: PPOConfig = PPOConfig()
  advantage: AdvantageConfig = AdvantageConfig()
  batching: BatchingConfig = BatchingConfig()
  mesh: MeshConfig = MeshConfig()
  generation: GenerationConfig = GenerationConfig()
  staleness: StalenessConfig = StalenessConfig()
  task: TaskConfig = TaskConfig()
  rollout: RolloutConfig = RolloutConfig()
  train: TrainConfig = TrainConfig()
  run: RunConfig = RunConfig()
  checkpoint: CheckpointConfig = CheckpointConfig()
  eval: EvalConfig = EvalConfig()
  log: LogConfig = LogConfig()
  sft: SFTConfig = SFTConfig()
  cpu: CPUConfig = CPUConfig()
  placement: PlacementConfig = PlacementConfig()

  def __post_init__(self):
    for name in ("batch_groups", "num_steps"):
      if getattr(self, name) < 1:
        fail(name, getattr(self, name), "must be >= 1")
    longest = self.generation.max_length
    if self.rollout.reward_timeout_s >= self.run.stall_timeout_s:
      fail("rollout.reward_timeout_s", self.rollout.reward_timeout_s,
           f"must be below run.stall_timeout_s={self.run.stall_timeout_s} (a reward call "
           f"that hangs is killed and scores 0; it must not stall the run first)")
    if self.batching.max_tokens_per_mb < longest:
      fail("batching.max_tokens_per_mb", self.batching.max_tokens_per_mb,
           f"must hold the longest allowed sequence (generation.max_prompt_len + "
           f"generation.max_new_tokens = {longest})")
    if longest > self.model.max_seq_len:
      fail("model.max_seq_len", self.model.max_seq_len,
           f"must be >= generation.max_prompt_len + generation.max_new_tokens = {longest}")
