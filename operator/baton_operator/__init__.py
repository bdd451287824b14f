"""baton's Kubernetes operator: reconciles InferenceService objects with kopf.

The package renders the runtime's CLI contract into pod specs; it never imports the runtime
itself (nor torch), so it runs from a slim image and imports in a second.
"""

from __future__ import annotations

GROUP = "baton.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferenceService"
PLURAL = "inferenceservices"

MANAGER = "baton-operator"
FINALIZER = f"{GROUP}/finalizer"

__all__ = ["API_VERSION", "FINALIZER", "GROUP", "KIND", "MANAGER", "PLURAL", "VERSION"]
