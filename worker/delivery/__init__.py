"""A batch's delivery: receipt and admission, its life (hooks, generate, store), the one decision of its end, the broker door, the lease, dead letters, and Celery behind one adapter."""
