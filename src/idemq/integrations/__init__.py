"""Framework integrations. Each lives in its own module and imports its framework lazily:

* :mod:`idemq.integrations.faststream` — ``IdempotencyMiddleware`` for FastStream ≥ 0.7
  (RabbitMQ, Kafka, NATS JetStream, Redis Streams, MQTT); needs ``idemq[faststream]``.
* :mod:`idemq.integrations.celery` — ``idempotent_task`` / ``IdempotentTask`` for
  ``acks_late`` Celery tasks; needs ``idemq[celery]``.

Nothing is imported here, so ``import idemq.integrations`` never needs either framework.
"""
