//! `/v1/destinations`: create or update, list, show with live figures.

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use serde_json::{json, Value};

use super::{ApiError, ApiJson, ApiState, PathParam};
use crate::destination::{DestinationConfig, DestinationName};
use crate::store::DestinationStatus;

/// Parses a destination name from the path, or answers 400.
pub(super) fn parse_name(raw: &str) -> Result<DestinationName, ApiError> {
    DestinationName::parse(raw).map_err(|e| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_destination_name",
            e.to_string(),
        )
    })
}

/// `PUT /v1/destinations/{name}`
pub(super) async fn put(
    State(state): State<ApiState>,
    PathParam(name): PathParam,
    ApiJson(cfg): ApiJson<DestinationConfig>,
) -> Result<Json<DestinationStatus>, ApiError> {
    let name = parse_name(&name)?;
    let spec = cfg
        .validate()
        .map_err(|e| ApiError::field("invalid_destination", e))?;
    Ok(Json(state.store.upsert_destination(&name, &spec).await?))
}

/// `GET /v1/destinations/{name}`
pub(super) async fn get(
    State(state): State<ApiState>,
    PathParam(name): PathParam,
) -> Result<Json<DestinationStatus>, ApiError> {
    let name = parse_name(&name)?;
    state
        .store
        .get_destination(name.as_str())
        .await?
        .map(Json)
        .ok_or_else(|| crate::store::Error::UnknownDestination(name.to_string()).into())
}

/// `GET /v1/destinations`
pub(super) async fn list(State(state): State<ApiState>) -> Result<Json<Value>, ApiError> {
    let all = state.store.list_destinations().await?;
    Ok(Json(json!({ "destinations": all })))
}
