"""The business table: a payment row per effect (no unique key, so a double effect shows)."""

from django.db import models


class Payment(models.Model):
    order_id = models.CharField(max_length=64)
    amount = models.IntegerField()

    class Meta:
        app_label = "shop"
