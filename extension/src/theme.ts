/**
 * Plotly figures that follow JupyterLab's theme (light, dark, or switched while shown).
 *
 * Why here: the kernel that draws a figure cannot know the lab's theme, so the workbench's
 * figures are drawn theme-neutral (transparent backgrounds, mid-grey text) and carry
 * `layout.meta.workbench` (workbench/ui/dashboard/style.py). This module tags each such
 * rendered plot (`data-colossal-theme`), also plots rendered or re-rendered later (a
 * MutationObserver, at most one scan per animation frame), and style/base.css paints a tagged
 * plot's text, grid and axis lines with the lab's `--jp-*` colours. CSS variables change with
 * the theme, so a theme switch restyles every shown plot at once, with no kernel round trip.
 * Plots a user draws with plotly's own templates are left alone.
 */

/** 'dark' or 'light': the lab's current theme, as JupyterLab marks it on the body. */
export function labTheme(): 'dark' | 'light' {
  return document.body.dataset.jpThemeLight === 'false' ? 'dark' : 'light';
}

interface IPlotDiv extends HTMLElement {
  layout?: { meta?: { workbench?: string } };
}

/** Tag every rendered workbench plot under `root` that is not tagged yet. */
export function tagPlots(root: ParentNode = document): number {
  let tagged = 0;
  root.querySelectorAll<IPlotDiv>('.js-plotly-plot').forEach(plot => {
    const mine = plot.layout?.meta?.workbench === 'themed';
    if (mine && plot.dataset.colossalTheme !== 'jp') {
      plot.dataset.colossalTheme = 'jp';
      tagged += 1;
    }
  });
  return tagged;
}

/** Keep tagging plots as they are rendered; returns the observer (to disconnect). */
export function watchPlots(): MutationObserver {
  let pending = false;
  const observer = new MutationObserver(() => {
    if (pending) {
      return;
    }
    pending = true;
    requestAnimationFrame(() => {
      pending = false;
      tagPlots();
    });
  });
  observer.observe(document.body, { childList: true, subtree: true });
  tagPlots();
  return observer;
}
