// Errors the client throws; the Python client's producer/errors.py has the same ones.

export class PagedqError extends Error {
  constructor(message, options) {
    super(message, options);
    this.name = this.constructor.name;
  }
}

/**
 * A job with this id exists already. `ids` lists the refused ids; `jobs` the jobs that were submitted
 * (submitMany submits every other job of the batch).
 */
export class DuplicateJobError extends PagedqError {
  constructor(message, ids, jobs = []) {
    super(message);
    this.ids = ids;
    this.jobs = jobs;
  }
}

/** No such job: never submitted, or its keys expired. */
export class JobNotFound extends PagedqError {
  constructor(message, jobId) {
    super(message);
    this.jobId = jobId;
  }
}

/** A request the client refuses before it reaches Redis. `field` names the offending field, when one does. */
export class InvalidRequestError extends PagedqError {
  constructor(message, field) {
    super(message);
    this.field = field;
  }
}

/** result() or stream() ran out of time; the job goes on. */
export class TimeoutError extends PagedqError {
  constructor(message, jobId) {
    super(message);
    this.jobId = jobId;
  }
}

/**
 * Redis stayed unreachable (a restart, a failover, the network) longer than the client's grace. `waited`: seconds
 * since the outage began (producer/ride.py's RedisUnavailable); `cause`: the last error met.
 */
export class RedisUnavailable extends PagedqError {
  constructor(message, waited, options) {
    super(message, options);
    this.waited = waited;
  }
}
