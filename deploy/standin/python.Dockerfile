# A stand-in for python:3.11-slim: Debian's Python 3.11 with pip, its headers (the official image has them; the CPU
# kernels compile against them) and `python`/`pip` on PATH; global pip installs allowed, as in the official image.
FROM pagedq-standin/debian:bookworm
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-dev python3-pip python3-venv \
    && rm -rf /var/lib/apt/lists/* /usr/lib/python3.11/EXTERNALLY-MANAGED \
    && ln -s /usr/bin/python3 /usr/local/bin/python && ln -s /usr/bin/pip3 /usr/local/bin/pip
ENV LANG=C.UTF-8
CMD ["python3"]
