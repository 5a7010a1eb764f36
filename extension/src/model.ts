/**
 * The pools the server knows, refreshed by a Poll (as dask-labextension and ipyparallel's lab
 * extension do): the sidebar and the status item both render from this one model, so they
 * never disagree. Polls every 2 s, every 0.5 s while some pool is busy, and backs off when
 * the server does not answer; every 0.5 s too while some pool serves an endpoint.
 */
import { ServerConnection } from '@jupyterlab/services';
import { Poll } from '@lumino/polling';
import { ISignal, Signal } from '@lumino/signaling';

import { requestAPI } from './request';

export type PoolState =
  | 'starting'
  | 'running'
  | 'busy'
  | 'restarting'
  | 'stopping'
  | 'stopped'
  | 'failed';

export type PoolAction = 'start' | 'stop' | 'restart';

export interface ITiers {
  device: number;
  host: number;
  disk: number;
}

export interface IRank {
  rank: number;
  engine_id: number;
  host: string;
  pid: number;
  device: string;
  backend: string;
  state: 'idle' | 'busy' | 'dead';
  memory: ITiers;
}

export interface ICell {
  label: string;
  running: boolean;
  elapsed: number;
  points: number;
  failed?: boolean;
}

/** A serving endpoint's figures (workbench/ui/dashboard/endpoint.py writes them). */
export interface IEndpoint {
  url: string;
  engine: string;
  model: string;
  replicas: number;
  status: 'serving' | 'failed' | 'stopping' | 'stopped';
  failure: string | null;
  requests: number;
  failed: number;
  requests_per_s: number;
  in_flight: number;
  running: number;
  waiting: number;
  kv_used: number;
  kv_total: number;
  line: string;
}

export interface IPool {
  id: string;
  kernel_id: string | null;
  notebook: string | null;
  kernel_here: boolean;
  state: PoolState;
  error: string | null;
  backend: string;
  world_size: number;
  ranks: IRank[];
  cell: ICell | null;
  /** The endpoint `%colossal serve` runs on this pool, while it serves. */
  endpoint?: IEndpoint | null;
}

export interface IActionReply {
  action: PoolAction;
  status: 'ok' | 'error' | 'pending';
  output: string;
  message?: string;
}

const IDLE_MS = 2000;
const BUSY_MS = 500;

export class PoolsModel {
  constructor(readonly settings: ServerConnection.ISettings) {
    this.poll = new Poll({
      auto: true,
      factory: () => this.refresh(),
      frequency: { interval: IDLE_MS, backoff: true, max: 30 * 1000 },
      name: 'colossal-workbench:pools',
      standby: 'when-hidden'
    });
  }

  readonly poll: Poll;
  pools: IPool[] = [];
  /** The last refresh's error, shown in the sidebar; null when the server answered. */
  error: string | null = null;

  get changed(): ISignal<this, void> {
    return this._changed;
  }

  /** The live pool of a kernel: the newest one that is not stopped, if any. */
  poolOfKernel(kernelId: string | null | undefined): IPool | null {
    if (!kernelId) {
      return null;
    }
    const mine = this.pools.filter(p => p.kernel_id === kernelId);
    const live = mine.filter(p => p.state !== 'stopped');
    return live[live.length - 1] || mine[mine.length - 1] || null;
  }

  async refresh(): Promise<void> {
    try {
      const reply = await requestAPI<{ pools: IPool[] }>('pools', this.settings);
      this.pools = reply.pools;
      this.error = null;
    } catch (err) {
      this.error = `cannot list pools: ${err}`;
      this._changed.emit();
      throw err; // the poll backs off
    }
    const busy = this.pools.some(
      p => (p.state !== 'running' && p.state !== 'stopped') || p.endpoint
    );
    const interval = busy ? BUSY_MS : IDLE_MS;
    if (this.poll.frequency.interval !== interval) {
      this.poll.frequency = { ...this.poll.frequency, interval };
    }
    this._changed.emit();
  }

  /** Run an action on a pool (by id) or on a kernel's pool (by kernel id). */
  async act(
    target: { poolId: string } | { kernelId: string },
    action: PoolAction,
    n?: number
  ): Promise<IActionReply> {
    const path =
      'poolId' in target
        ? `pools/${encodeURIComponent(target.poolId)}/${action}`
        : `kernels/${encodeURIComponent(target.kernelId)}/${action}`;
    const body = n === undefined ? {} : { n };
    try {
      return await requestAPI<IActionReply>(path, this.settings, {
        method: 'POST',
        body: JSON.stringify(body)
      });
    } finally {
      void this.poll.refresh();
    }
  }

  dispose(): void {
    this.poll.dispose();
  }

  private _changed = new Signal<this, void>(this);
}

/** "1.2 GiB" */
export function formatBytes(n: number): string {
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) {
    n /= 1024;
    i++;
  }
  return `${n.toFixed(i === 0 ? 0 : 1)} ${units[i]}`;
}

/** What the UI calls a state: a running pool with no cell is "idle". */
export function stateLabel(state: PoolState): string {
  return state === 'running' ? 'idle' : state;
}

/** A pool's state as the UI says it: "serving" while an endpoint runs on it. */
export function poolLabel(pool: IPool): string {
  return pool.endpoint && pool.state === 'running'
    ? 'serving'
    : stateLabel(pool.state);
}

/** "2.4 req/s, 3 in flight, queue 2 running / 1 waiting, KV 40/96 blocks" */
export function endpointFigures(e: IEndpoint): string {
  return (
    `${e.requests_per_s.toFixed(1)} req/s, ${e.in_flight} in flight, ` +
    `queue ${e.running} running / ${e.waiting} waiting, ` +
    `KV ${e.kv_used}/${e.kv_total} blocks`
  );
}
