from __future__ import annotations

from django.conf import settings
from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.contrib.auth.decorators import login_not_required
from django.urls import include, path

from console import views
from console.forms import LoginForm

urlpatterns = [
    path("", views.dashboard, name="dashboard"),
    path("healthz", views.healthz, name="healthz"),
    path("login/", auth_views.LoginView.as_view(authentication_form=LoginForm), name="login"),
    # Signing out without a session (signed out in another tab, expired) is already done:
    # the sign-in page, not a refusal saying what was sent was not done.
    path("logout/", login_not_required(auth_views.LogoutView.as_view()), name="logout"),
    path("audit/", views.audit_list, name="audit"),
    path("audit.csv", views.audit_csv, name="audit_csv"),
    path("operations/", include("operations.urls")),
    path("webhooks/", include("operations.webhooks")),
    path("approvals/", include("approvals.urls")),
    path("runs/", include("replays.urls")),
    path("admin/", admin.site.urls),
]

if settings.SANDBOX_ENABLED:
    urlpatterns.append(path("sandbox/", include("operations.sandbox.urls")))
