from django.urls import path

from apps.scheduling import views

urlpatterns = [
    path("cluster/", views.cluster, name="cluster"),
]
