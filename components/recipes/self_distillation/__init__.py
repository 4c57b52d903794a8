"""Self-distillation (DINO, Caron et al. 2021; DINOv2, Oquab et al. 2023) for the Swin ViT encoder."""

from .collapse import StopOnCollapse, TeacherCollapseError
from .loss import SelfDistillationLoss, koleo_loss
from .network import ProjectionHead, SelfDistillationNetwork, SwinViTEmbedding, weight_decay_groups
from .recipe import SelfDistillationRecipe, cosine_schedule
from .views import MultiCrop, MultiCropViews

__all__ = [
    "MultiCrop",
    "MultiCropViews",
    "ProjectionHead",
    "SelfDistillationLoss",
    "SelfDistillationNetwork",
    "SelfDistillationRecipe",
    "StopOnCollapse",
    "SwinViTEmbedding",
    "TeacherCollapseError",
    "cosine_schedule",
    "koleo_loss",
    "weight_decay_groups",
]
