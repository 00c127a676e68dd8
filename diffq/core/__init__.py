"""The base layer (import path `diffq.core`): what producer, worker and readers share.

Imports nothing above it: no producer, worker, results or app module.
"""
