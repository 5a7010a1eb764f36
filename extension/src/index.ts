/**
 * colossal-workbench's JupyterLab plugin: the "Colossal" left sidebar and a status-bar item,
 * both rendered from one PoolsModel that polls the server extension (workbench.ui.lab).
 */
import {
  ILabShell,
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { IThemeManager } from '@jupyterlab/apputils';
import { INotebookTracker } from '@jupyterlab/notebook';
import { IStatusBar } from '@jupyterlab/statusbar';
import { LabIcon } from '@jupyterlab/ui-components';

import { PoolsModel } from './model';
import { ColossalSidebar, IActiveKernel } from './sidebar';
import { ColossalStatus } from './status';
import { watchPlots } from './theme';

const ICON_SVG =
  '<svg xmlns="http://www.w3.org/2000/svg" width="16" height="16" viewBox="0 0 16 16">' +
  '<g class="jp-icon3" fill="#616161"><rect x="1" y="1" width="6" height="6" rx="1"/>' +
  '<rect x="9" y="1" width="6" height="6" rx="1"/><rect x="1" y="9" width="6" height="6" rx="1"/>' +
  '<rect x="9" y="9" width="6" height="6" rx="1"/></g></svg>';

export const colossalIcon = new LabIcon({
  name: 'colossal-workbench:pools',
  svgstr: ICON_SVG
});

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'colossal-workbench:plugin',
  description: 'Colossal sidebar and status item for colossal-workbench pools',
  autoStart: true,
  requires: [ILabShell],
  optional: [INotebookTracker, IStatusBar, IThemeManager],
  activate: (
    app: JupyterFrontEnd,
    labShell: ILabShell,
    tracker: INotebookTracker | null,
    statusBar: IStatusBar | null,
    themes: IThemeManager | null
  ) => {
    watchPlots(); // workbench plots follow the lab's theme (theme.ts, style/base.css)
    const model = new PoolsModel(app.serviceManager.serverSettings);
    const active = (): IActiveKernel | null => {
      const panel = tracker?.currentWidget;
      const kernel = panel?.sessionContext.session?.kernel;
      return panel && kernel
        ? { kernelId: kernel.id, path: panel.context.path }
        : null;
    };
    const sidebar = new ColossalSidebar(model, active);
    sidebar.title.icon = colossalIcon;
    labShell.add(sidebar, 'left', { rank: 200 });

    const status = new ColossalStatus(
      model,
      () => active()?.kernelId ?? null,
      () => labShell.activateById(sidebar.id)
    );
    const rerender = () => {
      sidebar.render();
      status.render();
    };
    tracker?.currentChanged.connect(rerender);
    // the sidebar's dashboard link carries the theme to the page it opens
    themes?.themeChanged.connect(rerender);
    tracker?.widgetAdded.connect((_, panel) =>
      panel.sessionContext.kernelChanged.connect(rerender)
    );
    statusBar?.registerStatusItem('colossal-workbench:status', {
      item: status,
      align: 'left',
      rank: 5
    });
    app.commands.addCommand('colossal-workbench:show-sidebar', {
      label: 'Show Colossal Pools',
      execute: () => labShell.activateById(sidebar.id)
    });
  }
};

export default plugin;
