"""Float8 / MXFP8 training of the Linear layers through torchao, applied to the model on meta
before it is parallelized (torchtitan's model-converter step)."""

import dataclasses

import torch
from torch import nn

from titan_exp.quantize.config import QuantizeConfig

# float8 matmuls need both dimensions of a weight to be multiples of 16.
_FLOAT8_ALIGNMENT = 16


def _keep(cfg: QuantizeConfig):
    def keep(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear) or any(name in fqn for name in cfg.filter_fqns):
            return False
        # Small or odd-shaped layers gain nothing and may not be supported by the kernels.
        return module.in_features % _FLOAT8_ALIGNMENT == 0 and module.out_features % _FLOAT8_ALIGNMENT == 0

    return keep


def convert_linears(model: nn.Module, cfg: QuantizeConfig, device: torch.device) -> None:
    """Swap the selected nn.Linear layers for torchao's low-precision training versions, in place."""
    if cfg.name == "float8":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig.from_recipe_name(cfg.recipe)
        if cfg.enable_fsdp_float8_all_gather:
            config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)  # a tensorwise option
        if device.type == "cpu":
            # torch's CPU _scaled_mm is a reference kernel (a 1024×256×768 matmul: 7 s, the debug
            # model's step: minutes); torchao's emulation casts to float8 alike and multiplies the
            # float8 values in high precision, as a GPU's float8 GEMM accumulates (0.07 s).
            config = dataclasses.replace(config, emulate=True)
        convert_to_float8_training(model, config=config, module_filter_fn=_keep(cfg))
    elif cfg.name == "mxfp8":
        if device.type != "cuda" or torch.cuda.get_device_capability(device) < (10, 0):
            raise RuntimeError(
                "quantize=mxfp8 needs a CUDA GPU with compute capability >= 10.0 (Blackwell); use quantize=float8"
            )
        from torchao.prototype.mx_formats import MXLinearConfig
        from torchao.quantization import quantize_

        quantize_(model, config=MXLinearConfig(), filter_fn=_keep(cfg))


def after_optimizer_step(model: nn.Module, cfg: QuantizeConfig) -> None:
    """With float8 all-gather, FSDP needs the weights' scales computed once per step, for all at once."""
    if cfg.name == "float8" and cfg.enable_fsdp_float8_all_gather:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(model)
