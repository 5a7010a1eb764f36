/**
 * The status-bar item: the focused notebook's pool ("Colossal: 2 ranks, busy", "serving"
 * while an endpoint runs on it), or a count
 * of pools when the focused notebook has none. Clicking it opens the sidebar.
 */
import { Widget } from '@lumino/widgets';

import { PoolsModel, poolLabel } from './model';

export class ColossalStatus extends Widget {
  constructor(
    private model: PoolsModel,
    private kernelId: () => string | null,
    onClick: () => void
  ) {
    super();
    this.addClass('jp-Colossal-status');
    this.node.title = 'Colossal pools: click to show the sidebar';
    this.node.onclick = onClick;
    model.changed.connect(this.render, this);
    this.render();
  }

  render(): void {
    const pool = this.model.poolOfKernel(this.kernelId());
    let text: string;
    if (pool && pool.state !== 'stopped') {
      text = `Colossal: ${pool.world_size} ranks, ${poolLabel(pool)}`;
    } else {
      const live = this.model.pools.filter(p => p.state !== 'stopped').length;
      text = live ? `Colossal: ${live} pool${live > 1 ? 's' : ''}` : 'Colossal: no pool';
    }
    this.node.textContent = text;
    this.node.dataset.state = pool ? pool.state : 'none';
  }

  dispose(): void {
    this.model.changed.disconnect(this.render, this);
    super.dispose();
  }
}
