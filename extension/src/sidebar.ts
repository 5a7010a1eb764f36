/**
 * The "Colossal" left sidebar: one card per pool (ranks, device per rank, memory per tier,
 * busy or idle, Start / Stop / Restart, a link to the live dashboard page, and while
 * `%colossal serve` runs on it the endpoint: address, state or failure, requests/s, in
 * flight, the engines' queue and KV blocks), plus a row for the active notebook's kernel so a
 * pool can be started from here when it has none.
 *
 * Plain DOM, rendered from the PoolsModel on every refresh and patched into the nodes shown
 * (what did not change stays): the content is small and the extension stays free of React.
 */
import { Widget } from '@lumino/widgets';

import {
  IEndpoint,
  IPool,
  IRank,
  PoolAction,
  PoolsModel,
  endpointFigures,
  formatBytes,
  poolLabel
} from './model';
import { apiUrl } from './request';
import { labTheme } from './theme';

/** What the sidebar needs to know about the notebook in focus. */
export interface IActiveKernel {
  kernelId: string;
  path: string;
}

type Children = (Node | string | null)[];

function h(
  tag: string,
  attrs: Record<string, string> = {},
  ...children: Children
): HTMLElement {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    node.setAttribute(key, value);
  }
  for (const child of children) {
    if (child !== null) {
      node.append(child);
    }
  }
  return node;
}

const ACTIONS_ALLOWED: Record<string, PoolAction[]> = {
  starting: [],
  running: ['stop', 'restart'],
  busy: ['stop', 'restart'],
  restarting: [],
  stopping: [],
  stopped: ['start'],
  failed: ['start', 'restart']
};

/**
 * Make `target` look like `source`, keeping the nodes that stay: a refresh (twice a second
 * while an endpoint serves) must not replace a button under the pointer, which would lose a
 * click that lands between its press and release.
 */
function patch(target: Node, source: Node): void {
  if (target instanceof HTMLElement && source instanceof HTMLElement) {
    for (const name of target.getAttributeNames()) {
      if (!source.hasAttribute(name)) {
        target.removeAttribute(name);
      }
    }
    for (const name of source.getAttributeNames()) {
      const value = source.getAttribute(name) as string;
      if (target.getAttribute(name) !== value) {
        target.setAttribute(name, value);
      }
    }
    if (target instanceof HTMLButtonElement && source instanceof HTMLButtonElement) {
      target.disabled = source.disabled;
      target.onclick = source.onclick; // the handler of this render (its pool, its state)
    }
  } else if (target.textContent !== source.textContent) {
    target.textContent = source.textContent;
    return;
  }
  const old = Array.from(target.childNodes);
  const fresh = Array.from(source.childNodes);
  fresh.forEach((child, i) => {
    const mine = old[i];
    if (
      mine === undefined ||
      mine.nodeType !== child.nodeType ||
      mine.nodeName !== child.nodeName
    ) {
      if (mine === undefined) {
        target.appendChild(child);
      } else {
        target.replaceChild(child, mine);
      }
    } else {
      patch(mine, child);
    }
  });
  for (const extra of old.slice(fresh.length)) {
    target.removeChild(extra);
  }
}

export class ColossalSidebar extends Widget {
  constructor(
    private model: PoolsModel,
    private activeKernel: () => IActiveKernel | null
  ) {
    super();
    this.id = 'colossal-workbench-sidebar';
    this.addClass('jp-Colossal-sidebar');
    this.title.caption = 'Colossal pools';
    model.changed.connect(this.render, this);
    this.render();
  }

  /** Re-render now, e.g. when another notebook gets the focus. */
  render(): void {
    const pools = this.model.pools;
    const content = h(
      'div',
      { class: 'jp-Colossal-content' },
      h('h2', { class: 'jp-Colossal-title' }, 'Colossal pools'),
      this.renderActive(),
      h('div', { class: 'jp-Colossal-message' }, this.message),
      this.model.error
        ? h('div', { class: 'jp-Colossal-error' }, this.model.error)
        : null,
      pools.length
        ? h(
            'div',
            { class: 'jp-Colossal-pools' },
            ...pools.map(p => this.renderPool(p))
          )
        : h(
            'p',
            { class: 'jp-Colossal-empty' },
            'No pool. Run %colossal start in a notebook, or Start one here.'
          )
    );
    const current = this.node.firstElementChild;
    if (current === null) {
      this.node.replaceChildren(content);
    } else {
      patch(current, content);
    }
  }

  private renderActive(): HTMLElement | null {
    const active = this.activeKernel();
    if (!active) {
      return null;
    }
    const pool = this.model.poolOfKernel(active.kernelId);
    const hasLive = pool !== null && pool.state !== 'stopped';
    const start = this.button('Start', 'start', !hasLive, () =>
      this.run({ kernelId: active.kernelId }, 'start')
    );
    return h(
      'div',
      { class: 'jp-Colossal-active', 'data-kernel-id': active.kernelId },
      h('span', {}, `${active.path}: `),
      h(
        'strong',
        {},
        hasLive ? `pool ${poolLabel(pool!)}` : 'no running pool'
      ),
      ' ',
      hasLive ? null : start
    );
  }

  private renderPool(pool: IPool): HTMLElement {
    const where = pool.notebook || `kernel ${pool.kernel_id || '(none)'}`;
    const header = h(
      'div',
      { class: 'jp-Colossal-poolHeader' },
      h('strong', {}, where),
      h(
        'span',
        { class: 'jp-Colossal-state', 'data-state': pool.state },
        `${pool.world_size} ranks, ${poolLabel(pool)}`
      )
    );
    const allowed = pool.kernel_here ? ACTIONS_ALLOWED[pool.state] || [] : [];
    const buttons = h(
      'div',
      { class: 'jp-Colossal-buttons' },
      ...(['start', 'stop', 'restart'] as PoolAction[]).map(action =>
        this.button(
          action[0].toUpperCase() + action.slice(1),
          action,
          allowed.includes(action),
          () => this.run({ poolId: pool.id }, action)
        )
      )
    );
    const dashboard = h(
      'a',
      {
        class: 'jp-Colossal-dashboardLink',
        // the page takes the lab's theme from its link, then follows the lab's theme setting
        href: apiUrl(`pools/${pool.id}/dashboard`, this.model.settings) + `?theme=${labTheme()}`,
        target: '_blank',
        rel: 'noopener'
      },
      'Live dashboard'
    );
    const cell = pool.cell
      ? h(
          'div',
          { class: 'jp-Colossal-cell' },
          `${pool.cell.running ? 'running' : 'last cell'}: ${pool.cell.label} ` +
            `(${pool.cell.elapsed.toFixed(1)} s) `,
          dashboard
        )
      : h('div', { class: 'jp-Colossal-cell' }, dashboard);
    return h(
      'div',
      {
        class: 'jp-Colossal-pool',
        'data-pool-id': pool.id,
        'data-state': pool.state,
        'data-ranks': String(pool.ranks.length)
      },
      header,
      pool.error ? h('div', { class: 'jp-Colossal-error' }, pool.error) : null,
      pool.ranks.length ? this.renderRanks(pool.ranks) : null,
      pool.endpoint ? this.renderEndpoint(pool.endpoint) : null,
      cell,
      buttons
    );
  }

  private renderEndpoint(e: IEndpoint): HTMLElement {
    return h(
      'div',
      {
        class: 'jp-Colossal-endpoint',
        'data-status': e.status,
        'data-url': e.url,
        'data-requests': String(e.requests),
        'data-requests-per-s': String(e.requests_per_s),
        'data-in-flight': String(e.in_flight),
        'data-kv-used': String(e.kv_used),
        'data-kv-total': String(e.kv_total)
      },
      h(
        'div',
        { class: 'jp-Colossal-endpointHead' },
        h('strong', {}, e.status),
        ` ${e.engine} at `,
        h('code', {}, e.url)
      ),
      h('div', { class: 'jp-Colossal-endpointFigures' }, endpointFigures(e)),
      e.failure ? h('div', { class: 'jp-Colossal-error' }, e.failure) : null
    );
  }

  private renderRanks(ranks: IRank[]): HTMLElement {
    const head = h(
      'tr',
      {},
      ...['rank', 'device', 'device mem', 'host mem', 'disk', 'state'].map(t =>
        h('th', {}, t)
      )
    );
    const rows = ranks.map(r =>
      h(
        'tr',
        { class: 'jp-Colossal-rank', 'data-state': r.state },
        h('td', {}, String(r.rank)),
        h('td', {}, r.device),
        h('td', {}, formatBytes(r.memory.device)),
        h('td', {}, formatBytes(r.memory.host)),
        h('td', {}, formatBytes(r.memory.disk)),
        h('td', {}, r.state)
      )
    );
    return h(
      'table',
      { class: 'jp-Colossal-ranks' },
      h('thead', {}, head),
      h('tbody', {}, ...rows)
    );
  }

  private button(
    label: string,
    action: PoolAction,
    enabled: boolean,
    onClick: () => void
  ): HTMLElement {
    const button = h(
      'button',
      {
        class: 'jp-Button jp-mod-styled jp-mod-small jp-Colossal-button',
        'data-action': action,
        title: `%colossal ${action}`
      },
      label
    ) as HTMLButtonElement;
    button.disabled = !enabled || this.busy;
    button.onclick = onClick;
    return button;
  }

  private async run(
    target: { poolId: string } | { kernelId: string },
    action: PoolAction
  ): Promise<void> {
    this.busy = true;
    this.message = `${action}...`;
    this.render();
    try {
      const reply = await this.model.act(target, action);
      this.message =
        reply.status === 'pending'
          ? `${action}: queued, the kernel is busy`
          : `${action}: ${reply.output.trim() || 'done'}`;
    } catch (err: any) {
      this.message = `${action} failed: ${err.message || err}`;
    } finally {
      this.busy = false;
      this.render();
    }
  }

  dispose(): void {
    this.model.changed.disconnect(this.render, this);
    super.dispose();
  }

  private busy = false;
  private message = '';
}
