# Build: the same cargo command CI's release build uses.
FROM rust:1.95-slim-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked --bin sluice

# Runtime: a small image, running as an unprivileged user.
FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --create-home --home-dir /var/lib/sluice sluice
COPY --from=build /src/target/release/sluice /usr/local/bin/sluice
USER sluice
WORKDIR /var/lib/sluice
# Inside a container the API must listen beyond loopback; set api.tokens in production.
ENV SLUICE_LISTEN=0.0.0.0:8080
EXPOSE 8080
ENTRYPOINT ["sluice"]
CMD ["serve"]
