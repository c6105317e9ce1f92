"""The worker's routes, one APIRouter per part of the API (create_app includes them)."""
