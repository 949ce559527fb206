//! The HTTP API (axum): destinations, enqueue, jobs, health and metrics.
//!
//! [`router`] builds the routes over an [`ApiState`]; [`serve`] runs them on a listener
//! until the shutdown token fires. Handlers validate input, call the store, and map
//! every failure through [`ApiError`].

use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, FromRequest, FromRequestParts, Request, State};
use axum::http::{header, request::Parts, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use serde::de::DeserializeOwned;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::config::ApiConfig;
use crate::metrics::Metrics;
use crate::store::{Enqueuer, Store};

mod destinations;
mod error;
mod jobs;

pub use error::ApiError;

/// What handlers share.
#[derive(Clone)]
pub struct ApiState {
    /// The job store.
    pub store: Store,
    /// Single enqueues, grouped into shared commits under load.
    pub enqueuer: Enqueuer,
    /// API settings (tokens, body limits).
    pub config: Arc<ApiConfig>,
    /// Process metrics, rendered by `GET /metrics`.
    pub metrics: Arc<Metrics>,
}

/// Builds the API router.
pub fn router(state: ApiState) -> Router {
    let single_limit = state.config.max_body_bytes;
    let batch_limit = state.config.max_batch_bytes;
    let v1 = Router::new()
        .route("/destinations", get(destinations::list))
        .route(
            "/destinations/{name}",
            put(destinations::put).get(destinations::get),
        )
        .route(
            "/destinations/{name}/jobs",
            post(jobs::enqueue).layer(DefaultBodyLimit::max(single_limit)),
        )
        .route(
            "/destinations/{name}/jobs/batch",
            post(jobs::enqueue_batch).layer(DefaultBodyLimit::max(batch_limit)),
        )
        .route("/jobs", get(jobs::list))
        .route("/jobs/{id}", get(jobs::get).delete(jobs::cancel))
        .route("/jobs/{id}/retry", post(jobs::retry))
        .layer(DefaultBodyLimit::max(single_limit));
    let protected = Router::new()
        .nest("/v1", v1)
        .route("/metrics", get(metrics))
        .route_layer(middleware::from_fn_with_state(state.clone(), auth));
    Router::new()
        .merge(protected)
        .route("/healthz", get(healthz))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state)
}

/// Serves the API on `listener` until `shutdown` is cancelled, then finishes in-flight
/// requests.
pub async fn serve(
    listener: TcpListener,
    state: ApiState,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    axum::serve(listener, router(state))
        .with_graceful_shutdown(async move { shutdown.cancelled().await })
        .await
}

/// Bearer-token check, active when `api.tokens` is non-empty.
async fn auth(State(state): State<ApiState>, req: Request, next: Next) -> Response {
    if state.config.tokens.is_empty() {
        return next.run(req).await;
    }
    let presented = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    let ok = presented.is_some_and(|p| {
        state
            .config
            .tokens
            .iter()
            .any(|t| constant_time_eq(t.as_bytes(), p.as_bytes()))
    });
    if ok {
        next.run(req).await
    } else {
        let mut resp = ApiError::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "a valid bearer token is required (Authorization: Bearer <token>)",
        )
        .into_response();
        resp.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            header::HeaderValue::from_static("Bearer"),
        );
        resp
    }
}

/// Compares secrets without leaking where they differ through timing.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn healthz(State(state): State<ApiState>) -> Result<Json<serde_json::Value>, ApiError> {
    state.store.now_us().await?;
    Ok(Json(serde_json::json!({"status": "ok"})))
}

async fn metrics(State(state): State<ApiState>) -> Result<Response, ApiError> {
    let destinations = state.store.list_destinations().await?;
    let body = state.metrics.render(&destinations);
    Ok((
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        body,
    )
        .into_response())
}

async fn not_found() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "not_found", "no such route")
}

async fn method_not_allowed() -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        "method not allowed on this route",
    )
}

/// `Json` whose rejections are [`ApiError`]s (JSON body, right status).
pub struct ApiJson<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let Json(v) = Json::<T>::from_request(req, state).await?;
        Ok(ApiJson(v))
    }
}

/// A path segment as a string, with rejections as [`ApiError`]s.
pub struct PathParam(pub String);

impl<S: Send + Sync> FromRequestParts<S> for PathParam {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        let axum::extract::Path(v) =
            axum::extract::Path::<String>::from_request_parts(parts, state).await?;
        Ok(PathParam(v))
    }
}
