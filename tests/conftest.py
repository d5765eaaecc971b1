"""Session setup shared by every test."""

from tests.tiny_open_clip import guard_torchvision_import

guard_torchvision_import()  # before anything imports torchvision (transformers, open_clip): see its docstring
