"""The Celery app both sides build (`make_celery`), and a worker's stop (`stop_consuming`).

The app reads the transport table (diffq/core/transports.py) for its broker's object and
facts; the table points at the broker classes (base.py, redis.py, ...), and none of them
imports the table back, so the app lives here, above both, not in base.py.
"""

from __future__ import annotations

from celery import Celery

from diffq.core.settings import get_settings
from diffq.core.transports import transport_for


def make_celery(broker_url: str, transport_options: dict | None = None) -> Celery:
    """The app both sides build. How a worker consumes and acks (late acks, prefetch 1,
    reject on a lost worker) is the worker's own policy: worker/delivery/celery_adapter.py."""
    settings = get_settings()
    transport = transport_for(broker_url)
    broker = transport.broker
    options = {**broker.options(settings), **settings.broker_transport_options, **(transport_options or {})}

    app = Celery("diffq", broker=broker_url, set_as_current=False)
    kombu_transport = broker.kombu_transport_for(broker_url)
    if kombu_transport:  # a class, not an alias: kombu's TRANSPORT_ALIASES stay as they are
        app.conf.broker_transport = kombu_transport
    app.conf.update(
        # JSON only: pickle is refused on both sides.
        task_serializer="json",
        accept_content=["json"],
        result_serializer="json",
        task_ignore_result=True,
        result_backend=None,
        broker_transport_options=options,
        # Celery reads the visibility timeout in two more places (result backend,
        # and the Redis `visibility_timeout` default); set all of them.
        result_backend_transport_options={"visibility_timeout": settings.visibility_timeout},
        visibility_timeout=settings.visibility_timeout,
        broker_connection_retry_on_startup=True,
        task_create_missing_queues=True,
        task_default_queue="diffq.default",
        worker_hijack_root_logger=False,
        worker_redirect_stdouts=False,
        worker_send_task_events=transport.monitored if settings.task_events is None else settings.task_events,
        worker_enable_remote_control=transport.monitored,
        task_send_sent_event=False,
    )
    return app


def stop_consuming(exit_code: int) -> None:
    """Ask Celery's worker to stop (its warm shutdown) and exit with `exit_code`. Here, not
    in worker/delivery/celery_adapter.py: a batch's life (worker/delivery/tasks.py) asks
    for it, and the adapter imports that life, so the life cannot import the adapter back."""
    from celery.worker import state as worker_state

    worker_state.should_stop = exit_code
