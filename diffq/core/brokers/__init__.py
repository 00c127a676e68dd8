"""One class per broker (redis.py, rabbitmq.py, sqs.py, embedded.py; what they share
and the `Broker` base in base.py): everything diffq does beyond kombu's public API.
With worker/delivery/celery_adapter.py, the only modules that import kombu or Celery
or read their private names (tests/test_broker_door.py)."""
