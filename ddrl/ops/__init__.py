"""Numerical kernels shared by several layers (torch only; estimators and models import them)."""
