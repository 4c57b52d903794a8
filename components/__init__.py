"""Components of the Swin UNETR self-supervised pretraining and finetuning bundles (``import components``)."""

from .augment import aug_rand, rot_rand, ssl_views
from .checkpoint import (
    BestModelSaver,
    CheckpointLoadError,
    LoadReport,
    PretrainedLoader,
    ResumableCheckpointSaver,
    ResumeHandler,
    convert_checkpoint,
    convert_state_dict,
    load_pretrained,
    save_atomic,
)
from .data import (
    EpochShuffleSampler,
    MissingDatalist,
    ResumableSmartCacheHandler,
    build_dataset,
    check_shard_sizes,
    load_datalist,
    load_split,
    partition_for_rank,
    require_datalist,
    rotate_smart_cache,
    split_for_rank,
)
from .datacheck import DataCheckError, DataIssue, DataReport, check_before_caching, check_datalist, check_items
from .distributed import (
    all_gather_with_grad,
    all_reduce_mean,
    barrier,
    cleanup_distributed,
    device_for_rank,
    get_rank,
    get_world_size,
    init_distributed,
    wrap_ddp,
)
from .engine import PretrainingEvaluator, PretrainingTrainer, Recipe
from .faults import (
    DataItemError,
    NonFiniteLossError,
    SourceNamingCompose,
    StopOnNonFiniteLoss,
    batch_filenames,
    item_sources,
    resolve_resume,
)
from .losses import SSLLoss
from .networks import SSLHead, check_roi_size
from .recipes import (
    InpaintingContrastRecipe,
    MultiCrop,
    SelfDistillationLoss,
    SelfDistillationNetwork,
    SelfDistillationRecipe,
    SSLEvaluator,
    SSLTrainer,
    SSLViewsImageHandler,
    StopOnCollapse,
    SwinViTEmbedding,
    TeacherCollapseError,
    weight_decay_groups,
)
from .package import extract_zip_safely, fetch, fetch_bundle, package_bundle, schema_path
from .quiet import install_filters, log_from_rank_zero
from .runtime import as_bool, default_num_workers, optional_path, tune_allocator
from .settings import check_settings
from .segmentation import PerClassMetrics, brats_labels_from_regions, per_class_means
from .synthetic import write_dataset
from .transforms import CompactCropForegroundd, RandCompactSpatialCropSamplesd, compact_nbytes

__version__ = "0.2.0"

install_filters()
