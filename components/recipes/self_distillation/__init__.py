"""Self-distillation (DINO, Caron et al. 2021; DINOv2, Oquab et al. 2023) for the Swin ViT encoder."""

from .collapse import StopOnCollapse, TeacherCollapseError
from .loss import SelfDistillationLoss, check_koleo_batch, koleo_loss
from .network import ProjectionHead, SelfDistillationNetwork, SwinViTEmbedding, weight_decay_groups
from .recipe import SelfDistillationRecipe, cosine_schedule, teacher_copy
from .settings import SELF_DISTILLATION_SETTINGS
from .views import MultiCrop, MultiCropViews, gaussian_blur

__all__ = [
    "SELF_DISTILLATION_SETTINGS",
    "MultiCrop",
    "MultiCropViews",
    "ProjectionHead",
    "SelfDistillationLoss",
    "SelfDistillationNetwork",
    "SelfDistillationRecipe",
    "StopOnCollapse",
    "SwinViTEmbedding",
    "TeacherCollapseError",
    "check_koleo_batch",
    "cosine_schedule",
    "gaussian_blur",
    "koleo_loss",
    "teacher_copy",
    "weight_decay_groups",
]
