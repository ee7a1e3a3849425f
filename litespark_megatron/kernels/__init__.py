"""Litespark's own kernels, each beside the plain-torch reference that defines it (the tests hold one to the other).
"""
