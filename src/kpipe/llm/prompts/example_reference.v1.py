import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()

    def forward(self, a, b):
        return a + b


def get_inputs():
    return [torch.randn(1, 128), torch.randn(1, 128)]


def get_init_inputs():
    return []
