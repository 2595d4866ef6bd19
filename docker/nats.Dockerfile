# NATS server from Debian's package, for hosts that cannot pull the official `nats` image.
# Used like it: the entrypoint is nats-server, compose passes its flags.
ARG BASE_IMAGE=debian:bookworm
FROM ${BASE_IMAGE}
RUN apt-get update -q \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends nats-server wget \
    && rm -rf /var/lib/apt/lists/* \
    && nats-server --version
EXPOSE 4222 6222 8222
ENTRYPOINT ["nats-server"]
CMD ["-js", "-sd", "/data", "-m", "8222"]
