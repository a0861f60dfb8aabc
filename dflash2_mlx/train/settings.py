"""What a training run is given (`TrainSettings`), checked, and the drafter's shape it implies (`settle`)."""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, field, fields, replace

from ..formats.config import DraftConfig, default_target_layer_ids
from ..loading import resolve_path
from ..target import Target

# settings a resumed run may change: none changes the training path
RESUMABLE = ("steps", "eval_every", "checkpoint_every", "time_budget", "ema", "peer_timeout", "feature_engine")


@dataclass
class TrainSettings:
    data: str
    architecture: str | None = None  # "dflash2" or "v1"; None: dflash2, or the shape of `init_from`
    block_size: int = 8
    layers: int | None = None  # None: 1 for a new drafter, an `init_from` folder's (more: layers added on top)
    steps: int = 1000
    sequences_per_step: int = 4
    anchors_per_sequence: int = 32
    learning_rate: float = 6e-4
    warmup: float = 0.04
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    gamma: float | None = None  # None: the paper's value for the block size (7 @ 16, 5 @ 10, 4 @ 8)
    selector_rank: int = 64
    selector_top_k: int = 16
    selector_factorized: bool = True
    mask_token_id: int | None = None
    seed: int = 0
    eval_every: int = 100
    checkpoint_every: int = 50
    eval_samples: int = 40
    cache_features: bool = True  # the training samples' features computed once, kept in the data folder (the
    # held-out samples' always are)
    feature_engine: str = "auto"  # what computes the features: "mlx", "torch" or "auto" (as `dflash2 data`)
    reduced_vocabulary: bool = True  # the loss's softmax over the tokens of the training data only
    draft_vocab: int | None = None  # train (and draft) over the N most frequent tokens of the training responses
    init_from: str | None = None  # a drafter folder to start from (its config fixes the drafter's shape;
    # a v1 folder with architecture "dflash2" warm-starts a DFlash 2 drafter: its DFlash 2 modules start as identity)
    init_from_target: bool = False  # the drafter's layers and final norm start as the target's last layers
    distill: float = 0.0  # weight of the soft loss to the target's top-k next tokens (1 - it: the hard labels')
    chain_loss: float = 0.0  # weight of the expected accepted length term (`loss.expected_accepted`), subtracted
    distinct_anchors: bool = False  # a sequence's anchors drawn without replacement (all its positions if fewer)
    time_budget: float | None = None  # minutes of wall time per run: stop there with a checkpoint (rerun to go on)
    ema: float = 0.999  # decay of an exponential moving average of the weights, which is what is evaluated and
    # exported (the raw weights' tau is logged beside it); 0: off. Switching it on in a resumed run starts the
    # average at that run's weights (what it adds: runs/smollm2/recipes/README.md)
    peer_timeout: float = 300.0  # data-parallel runs (mlx.launch): seconds a rank waits for the others before it
    # stops with an error (a rank that died or hangs), and a fresh start waits for them to join
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if not 0 <= self.ema < 1:
            raise ValueError(
                f"ema {self.ema} is not a decay: give one in [0, 1), e.g. 0.999 (0 turns the moving average off)"
            )
        if self.eval_samples < 1:
            raise ValueError(
                f"eval_samples {self.eval_samples}: evaluations and the feature scale need at least one sample"
            )

    def loss_gamma(self) -> float:
        if self.gamma is not None:
            return self.gamma
        return 7.0 if self.block_size >= 16 else 5.0 if self.block_size >= 10 else 4.0

    def changes_from(self, recorded: dict) -> dict[str, tuple]:
        """{name: (recorded value, this value)} of the settings that differ from `recorded` (a checkpoint's)
        and would change the training path; settings added after it was written take their defaults,
        which is what it ran with."""
        defaults = {f.name: f.default for f in fields(TrainSettings) if f.default is not MISSING}
        recorded = {k: v for k, v in {**defaults, **recorded}.items() if k not in RESUMABLE}
        current = {k: v for k, v in asdict(self).items() if k not in RESUMABLE}
        return {k: (recorded.get(k), v) for k, v in current.items() if recorded.get(k) != v}


def check_world_size(settings: TrainSettings, size: int | None) -> None:
    """Each of `size` data-parallel ranks takes every size-th sequence of a step's batch: the batch must split
    evenly (the ranks then do the same work in the same shapes at every step; none waits for another, none is
    left without a sequence)."""
    n = settings.sequences_per_step
    if size and size > 1 and n % size:
        down, up = n // size * size, -(-n // size) * size
        fixes = " or ".join(f"--sequences-per-step {k}" for k in (down, up) if k)
        raise ValueError(
            f"--sequences-per-step {n} does not split over {size} ranks (each takes one in {size} of "
            f"a step's sequences): give {fixes}, or launch a number of ranks that divides {n}"
        )


def settle(settings: TrainSettings, model) -> tuple[TrainSettings, DraftConfig]:
    """The settings with the architecture decided, and the drafter's config: an `init_from` folder's (its
    shape recorded in the settings, so that the loss, the card and resume agree), else a new drafter shaped
    like the target's own layers."""
    if not settings.init_from:
        settings = replace(settings, architecture=settings.architecture or "dflash2", layers=settings.layers or 1)
        return settings, drafter_config(Target(model), settings)
    config = DraftConfig.from_path(resolve_path(settings.init_from))
    config = upgraded(config, settings) if settings.architecture == "dflash2" else config
    config = deepened(config, settings.layers)
    if settings.architecture == "v1" and config.is_dflash2:
        raise ValueError(
            f"{settings.init_from} is a DFlash 2 drafter; it can be fine-tuned as one (leave out "
            "--arch) but not trained as a v1 drafter"
        )
    settings = replace(
        settings,
        architecture="dflash2" if config.is_dflash2 else "v1",
        block_size=config.block_size,
        layers=config.num_hidden_layers,
        mask_token_id=config.mask_token_id,
    )
    return settings, config


def drafter_config(target: Target, settings: TrainSettings) -> DraftConfig:
    """A new drafter shaped like the target's own layers."""
    args = target.model.args
    heads = getattr(args, "num_attention_heads", 8)
    n = target.num_layers
    ids = default_target_layer_ids(n) if n >= 8 else tuple(sorted({round(i * (n - 1) / 4) for i in range(5)}))
    dflash2 = settings.architecture != "v1"
    return DraftConfig(
        architecture="DFlash2DraftModel" if dflash2 else "DFlashDraftModel",
        hidden_size=target.hidden_size,
        num_hidden_layers=settings.layers,
        num_attention_heads=heads,
        num_key_value_heads=getattr(args, "num_key_value_heads", None) or heads,
        head_dim=getattr(args, "head_dim", None) or target.hidden_size // heads,
        intermediate_size=getattr(args, "intermediate_size", 4 * target.hidden_size),
        rms_norm_eps=getattr(args, "rms_norm_eps", 1e-6),
        rope_theta=float(getattr(args, "rope_theta", 10000.0)),
        block_size=settings.block_size,
        target_layer_ids=ids,
        mask_token_id=settings.mask_token_id if settings.mask_token_id is not None else target.vocab_size - 1,
        vocab_size=target.vocab_size,
        num_target_layers=n,
        is_causal=False,
        conv_kernel_size=2 if dflash2 else 0,
        conv_group_size=16 if dflash2 else 0,
        selector_rank=settings.selector_rank if dflash2 else 0,
        selector_top_k=settings.selector_top_k if dflash2 else 0,
        selector_factorized=settings.selector_factorized and dflash2,
    )


def deepened(config: DraftConfig, layers: int | None) -> DraftConfig:
    """An `init_from` folder's config with `layers` layers: its own (None), or more, added on top of its own (they
    start as the identity: `init_weights.identity_layer`)."""
    have = config.num_hidden_layers
    if layers is None or layers == have:
        return config
    if layers < have:
        raise ValueError(
            f"--layers {layers}: the --init-from drafter has {have} layers, and a warm start keeps them all "
            f"(leave out --layers, or give {have} or more to add layers on top)"
        )
    return replace(
        config, num_hidden_layers=layers, layer_types=config.layer_types + config.layer_types[-1:] * (layers - have)
    )


def upgraded(config: DraftConfig, settings: TrainSettings) -> DraftConfig:
    """A v1 drafter's config as a DFlash 2 one (the modules DFlash 2 adds shaped by `settings`)."""
    if config.is_dflash2:
        return config
    return replace(
        config,
        architecture="DFlash2DraftModel",
        conv_kernel_size=2,
        conv_group_size=16,
        selector_rank=settings.selector_rank,
        selector_top_k=settings.selector_top_k,
        selector_factorized=settings.selector_factorized,
        vocab_size=config.vocab_size,
    )
