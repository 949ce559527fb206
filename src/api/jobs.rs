//! Enqueue (single and batch) and job lookups.

use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::json;
use uuid::Uuid;

use super::destinations::parse_name;
use super::{ApiError, ApiJson, ApiState, PathParam};
use crate::job::{Job, JobRequest, JobState};
use crate::store::JobFilter;

/// `POST /v1/destinations/{name}/jobs` → 202 with the new job, or 200 with the job an
/// earlier request created under the same idempotency key.
pub(super) async fn enqueue(
    State(state): State<ApiState>,
    PathParam(name): PathParam,
    ApiJson(req): ApiJson<JobRequest>,
) -> Result<Response, ApiError> {
    let name = parse_name(&name)?;
    let job = req
        .validate("")
        .map_err(|e| ApiError::field("invalid_job", e))?;
    let a = state.enqueuer.enqueue(name.as_str(), job).await?;
    let status = if a.created {
        StatusCode::ACCEPTED
    } else {
        StatusCode::OK
    };
    Ok((status, Json(json!({"id": a.id, "state": a.state}))).into_response())
}

/// Body of the batch endpoint.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Batch {
    jobs: Vec<JobRequest>,
}

/// `POST /v1/destinations/{name}/jobs/batch`: all jobs are admitted or none is.
pub(super) async fn enqueue_batch(
    State(state): State<ApiState>,
    PathParam(name): PathParam,
    ApiJson(batch): ApiJson<Batch>,
) -> Result<Response, ApiError> {
    let name = parse_name(&name)?;
    if batch.jobs.is_empty() || batch.jobs.len() > state.config.max_batch_jobs {
        return Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_batch",
            format!(
                "a batch holds 1 to {} jobs, got {}",
                state.config.max_batch_jobs,
                batch.jobs.len()
            ),
        ));
    }
    let jobs = batch
        .jobs
        .iter()
        .enumerate()
        .map(|(i, j)| j.validate(&format!("jobs[{i}].")))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| ApiError::field("invalid_job", e))?;
    let admitted = state.store.enqueue(name.as_str(), &jobs).await?;
    let status = if admitted.iter().any(|a| a.created) {
        StatusCode::ACCEPTED
    } else {
        StatusCode::OK
    };
    Ok((status, Json(json!({ "jobs": admitted }))).into_response())
}

fn parse_id(raw: &str) -> Result<Uuid, ApiError> {
    Uuid::parse_str(raw).map_err(|_| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_job_id",
            format!("{raw:?} is not a job id (a UUID)"),
        )
    })
}

/// `GET /v1/jobs/{id}`
pub(super) async fn get(
    State(state): State<ApiState>,
    PathParam(id): PathParam,
) -> Result<Json<Job>, ApiError> {
    let id = parse_id(&id)?;
    state
        .store
        .get_job(id)
        .await?
        .map(Json)
        .ok_or_else(|| crate::store::Error::UnknownJob(id).into())
}

/// `DELETE /v1/jobs/{id}`: cancels a queued job (409 once it was claimed or finished).
pub(super) async fn cancel(
    State(state): State<ApiState>,
    PathParam(id): PathParam,
) -> Result<Json<Job>, ApiError> {
    let id = parse_id(&id)?;
    Ok(Json(state.store.cancel_job(id).await?))
}

/// `POST /v1/jobs/{id}/retry`: puts a dead job back in line with fresh attempts (429
/// when the destination is full, 409 unless the job is dead).
pub(super) async fn retry(
    State(state): State<ApiState>,
    PathParam(id): PathParam,
) -> Result<Json<Job>, ApiError> {
    let id = parse_id(&id)?;
    Ok(Json(state.store.retry_dead_job(id).await?))
}

/// Query of `GET /v1/jobs`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ListQuery {
    destination: Option<String>,
    state: Option<String>,
    limit: Option<u32>,
}

/// `GET /v1/jobs?destination=&state=&limit=`: newest first.
pub(super) async fn list(
    State(state): State<ApiState>,
    query: Result<Query<ListQuery>, QueryRejection>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let Query(q) = query?;
    let job_state = q
        .state
        .as_deref()
        .map(str::parse::<JobState>)
        .transpose()
        .map_err(|m| ApiError::new(StatusCode::BAD_REQUEST, "bad_query", m))?;
    let filter = JobFilter {
        destination: q.destination,
        state: job_state,
        limit: q.limit,
    };
    let jobs = state.store.list_jobs(&filter).await?;
    Ok(Json(json!({ "jobs": jobs })))
}
