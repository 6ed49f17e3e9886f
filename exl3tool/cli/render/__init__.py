"""Renderers: library report dataclasses -> Rich output or JSON. No logic beyond presentation."""
