/**
 * Calls to the server extension (routes under /workbench, see workbench/ui/lab/handlers.py).
 * Adapted from the extension template's request helper: every call goes through
 * ServerConnection, which adds the token and XSRF headers of this JupyterLab session.
 */
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

/** The namespace of the server extension's routes. */
export const API_NAMESPACE = 'workbench';

/** An HTTP error with the server's JSON message, e.g. "unknown pool 'x'". */
export class APIError extends Error {
  constructor(
    readonly status: number,
    message: string,
    readonly body: any
  ) {
    super(message);
  }
}

export function apiUrl(
  endPoint: string,
  settings: ServerConnection.ISettings
): string {
  return URLExt.join(settings.baseUrl, API_NAMESPACE, endPoint);
}

/**
 * Call the server extension and parse its JSON answer; non-2xx answers throw an APIError
 * carrying the server's message. 202 (action still running in the kernel) is a success.
 */
export async function requestAPI<T>(
  endPoint: string,
  settings: ServerConnection.ISettings,
  init: RequestInit = {}
): Promise<T> {
  let response: Response;
  try {
    response = await ServerConnection.makeRequest(
      apiUrl(endPoint, settings),
      init,
      settings
    );
  } catch (error) {
    throw new ServerConnection.NetworkError(error as any);
  }
  const text = await response.text();
  let data: any = text;
  if (text.length > 0) {
    try {
      data = JSON.parse(text);
    } catch (error) {
      console.warn('colossal-workbench: not a JSON response', response);
    }
  }
  if (!response.ok) {
    const message = (data && data.message) || response.statusText;
    throw new APIError(response.status, message, data);
  }
  return data as T;
}
