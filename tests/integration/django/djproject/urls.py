"""The test project's views."""

from django.urls import path

from tests.integration.django.shop import views

urlpatterns = [
    path("pay", views.pay),
    path("pay-async", views.pay_async),
    path("fail", views.fail),
    path("count", views.count),
]
