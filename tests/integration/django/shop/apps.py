from django.apps import AppConfig


class ShopConfig(AppConfig):
    name = "tests.integration.django.shop"
    label = "shop"
