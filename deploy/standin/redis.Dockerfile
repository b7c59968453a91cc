# A stand-in for redis:7: Debian's Redis 7.0 run as the redis user in /data, as the official image does.
FROM pagedq-standin/debian:bookworm
RUN apt-get update \
    && apt-get install -y --no-install-recommends redis-server redis-tools \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /data && chown redis:redis /data
WORKDIR /data
USER redis
EXPOSE 6379
CMD ["redis-server"]
