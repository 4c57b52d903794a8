"""The inpainting / contrastive recipe of Tang et al. (CVPR 2022) for the Swin ViT encoder: the SSL head (rotation,
contrastive and reconstruction heads), the two corrupted rotated views, the three-part loss, and the recipe object
the trainer runs."""

from .loss import SSLLoss, nt_xent_loss
from .network import OUTPUT_MODES, UPSAMPLE_MODES, SSLHead
from .recipe import InpaintingContrastRecipe, SSLEvaluator, SSLTrainer, SSLViewsImageHandler
from .settings import SSL_SETTINGS
from .views import SSLViews, aug_rand, input_corruption, rot_rand, ssl_views

__all__ = [
    "InpaintingContrastRecipe",
    "OUTPUT_MODES",
    "SSLEvaluator",
    "SSLHead",
    "SSLLoss",
    "SSLTrainer",
    "SSLViews",
    "SSLViewsImageHandler",
    "SSL_SETTINGS",
    "UPSAMPLE_MODES",
    "aug_rand",
    "input_corruption",
    "nt_xent_loss",
    "rot_rand",
    "ssl_views",
]
