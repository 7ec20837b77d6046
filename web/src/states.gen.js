// Generated from contracts/states.py: do not edit. Regenerate with
// python -m torchyard.contracts.states --js web/src/states.gen.js

export const JOB = Object.freeze({"QUEUED": "queued", "STARTING": "starting", "RUNNING": "running", "CANCELLING": "cancelling", "SUCCEEDED": "succeeded", "FAILED": "failed", "CANCELLED": "cancelled"});
export const JOB_STATES = Object.freeze(["queued", "starting", "running", "cancelling", "succeeded", "failed", "cancelled"]);
export const JOB_TERMINAL = new Set(["cancelled", "failed", "succeeded"]);
export const JOB_ACTIVE = new Set(["cancelling", "running", "starting"]);
export const JOB_TRANSITIONS = Object.freeze({"queued": ["cancelled", "failed", "starting"], "starting": ["cancelled", "cancelling", "failed", "queued", "running"], "running": ["cancelling", "failed", "queued", "succeeded"], "cancelling": ["cancelled", "failed", "succeeded"], "succeeded": [], "failed": [], "cancelled": []});
export const ATTEMPT = Object.freeze({"STARTING": "starting", "RUNNING": "running", "SUCCEEDED": "succeeded", "FAILED": "failed", "LOST": "lost", "HANDED_BACK": "handed_back", "CANCELLED": "cancelled"});
export const ATTEMPT_STATES = Object.freeze(["starting", "running", "succeeded", "failed", "lost", "handed_back", "cancelled"]);
export const ATTEMPT_ACTIVE = new Set(["running", "starting"]);
export const ATTEMPT_COUNTED = new Set(["failed", "lost"]);
export const WORKER = Object.freeze({"IDLE": "idle", "BUSY": "busy", "LOST": "lost", "STOPPED": "stopped"});
export const WORKER_STATES = Object.freeze(["idle", "busy", "lost", "stopped"]);
export const WORKER_LIVE = new Set(["busy", "idle"]);
